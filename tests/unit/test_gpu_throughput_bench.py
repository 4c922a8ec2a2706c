"""bench/gpu_throughput.py at tiny shapes on the CPU: every row runs, its two sides compute the same
function (the bench asserts the initial losses; here the first step's losses are checked against them
too), the nanoGPT row runs with a checkout (LMFORGE_NANOGPT) and is skipped with how to get one without,
and --memory measures that train.loss_chunk_tokens lowers the step's peak. Also train_throughput's
nanogpt shape."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_throughput  # noqa: E402  (bench/ is not a package)
import nanogpt_ref  # noqa: E402
import train_throughput  # noqa: E402
from lmforge.models.flops import count_params  # noqa: E402

NANOGPT = os.environ.get(nanogpt_ref.ENV)
CLONE = "git clone https://github.com/karpathy/nanoGPT"
FAST = ["--tiny", "--device", "cpu", "--rounds", "3", "--warmup", "1", "--threads", "1", "--peak-n", "256"]


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()  # the benches set the process's thread count
    yield
    torch.set_num_threads(n)


def test_tiny_rows_run_and_both_sides_compute_the_same_function(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu_throughput.main([*FAST, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert res["machine"]["tiny"] is True and res["machine"]["precision"] == "fp32"
    assert set(rows) == {"gpt2", "llama", "llama1b"}
    if NANOGPT is None:
        assert rows["gpt2"]["skipped"].startswith("no nanoGPT checkout given") and CLONE in printed
    ran = [n for n in rows if "skipped" not in rows[n]]
    assert ("gpt2" in ran) == (NANOGPT is not None) and {"llama", "llama1b"} <= set(ran)
    for name in ran:
        r = rows[name]
        spec = gpu_throughput.TINY_ROWS[name]
        base = "nanogpt" if name == "gpt2" else "hf"
        assert r["baseline"] == base
        assert r["params"] == count_params(gpu_throughput.model_config(spec))
        check = r["initial_loss_check"]
        assert check["abs_diff"] < 1e-4
        # The first step starts from the copied weights on batch 0: its losses are the checked ones
        # (HF's timed call passes labels=x, which drops each row's last target).
        first = r["first_step"]
        assert abs(first["lmforge"]["loss"] - check["loss_lmforge"]) < 1e-5
        their = check["loss_nanogpt"] if base == "nanogpt" else check["loss_hf_labels_x"]
        assert abs(first[base]["loss"] - their) < 1e-5
        for side in ("lmforge", base):
            s = r["sides"][side]
            assert len(s["raw_step_s"]) == 3 and s["peak_mem_mib"] is None  # CPU: no CUDA allocator
            tokens = spec["batch"] * spec["seq_len"]
            assert s["tokens_per_s"] == pytest.approx(tokens / (s["median_ms"] / 1e3))
        sides = r["sides"]
        assert r["ratio"] == pytest.approx(sides[base]["median_ms"] / sides["lmforge"]["median_ms"])
        assert r["peak_source"].startswith("measured fp32 matmul")
        table = [line.split("|")[1].strip() for line in printed.splitlines() if line.startswith("|")]
        assert name in table


def test_missing_nanogpt_checkout_skips_the_row_with_how_to_get_one(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    missing = tmp_path / "no-such-dir"
    assert gpu_throughput.main([*FAST, "--rows", "gpt2", "--nanogpt", str(missing), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    skipped = json.loads(out.read_text())["rows"]["gpt2"]["skipped"]
    assert str(missing) in skipped and CLONE in skipped and CLONE in printed


def test_memory_mode_chunked_loss_lowers_the_step_peak(tmp_path):
    out = tmp_path / "mem.json"
    argv = ["--memory", "--tiny", "--device", "cpu", "--chunks", "256", "--memory-steps", "2",
            "--threads", "1"]
    assert gpu_throughput.main([*argv, "--out", str(out)]) == 0
    mem = json.loads(out.read_text())["memory"]
    plain, chunked = mem["settings"]["0"], mem["settings"]["256"]
    assert plain["fits"] and chunked["fits"]
    # The plain step holds the (2048 x 8192) fp32 logits and their gradient: 64 MiB each.
    assert mem["logits_mib"]["fp32"] == 64
    assert plain["step_rise_mib"] - chunked["step_rise_mib"] > 0.5 * mem["logits_mib"]["fp32"]


@pytest.mark.skipif(NANOGPT is None, reason=f"no nanoGPT checkout ({nanogpt_ref.ENV})")
def test_train_throughput_nanogpt_shape(tmp_path):
    out = tmp_path / "tt.json"
    argv = ["--shapes", "nanogpt", "--rounds", "2", "--warmup", "1", "--threads", "1", "--peak-n", "256"]
    assert train_throughput.main([*argv, "--out", str(out)]) == 0
    r = json.loads(out.read_text())["results"]["nanogpt"]
    assert r["baseline"] == "nanogpt" and r["initial_loss_check"]["abs_diff"] < 1e-4
    assert r["shape"] == dict(n_layers=4, n_heads=4, d_model=128, d_ff=512, seq_len=64, batch=12, vocab=65)
    sides = r["sides"]
    assert r["ratio"] == pytest.approx(sides["nanogpt"]["median_ms"] / sides["lmforge"]["median_ms"])


def test_nanogpt_state_mapping_covers_every_nanogpt_tensor():
    """The lmforge -> nanoGPT key map, checked against nanoGPT's own names where a checkout exists."""
    cfg = nanogpt_ref.gpt2_config(n_layers=2, n_heads=2, d_model=8, seq_len=4, vocab=16)
    from lmforge.models.transformer import Transformer

    torch.manual_seed(0)
    ours = Transformer(cfg)
    mapped = nanogpt_ref.lmforge_to_nanogpt_state(ours.state_dict(), cfg.n_layers)
    sd = ours.state_dict()
    assert torch.equal(mapped["transformer.h.1.attn.c_attn.weight"],
                       torch.cat([sd[f"layers.1.attn.{w}.weight"] for w in ("wq", "wk", "wv")]))
    assert mapped["lm_head.weight"] is mapped["transformer.wte.weight"]
    if NANOGPT is not None:
        nano = nanogpt_ref.build_nanogpt(nanogpt_ref.load_nanogpt(Path(NANOGPT)), cfg, torch.device("cpu"))
        theirs = {k: v.shape for k, v in nano.state_dict().items() if not k.endswith(".attn.bias")}
        assert {k: v.shape for k, v in mapped.items()} == theirs
