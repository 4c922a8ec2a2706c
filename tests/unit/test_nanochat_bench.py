"""bench/train_throughput.py's nanochat row: with a nanochat checkout (LMFORGE_NANOCHAT) it runs at a tiny
shape and reports both sides; without one it prints how to get one and exits 0. Also that lmforge's
side has the same matmul work as nanochat's model (same shapes, GELU MLP of 4 x d_model)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import nanochat_ref  # noqa: E402  (bench/ is not a package)
import train_throughput  # noqa: E402
from lmforge.models.flops import count_params  # noqa: E402

NANOCHAT = os.environ.get(nanochat_ref.ENV)
CLONE = "git clone https://github.com/karpathy/nanochat"
# head_dim 32, two layers (nanochat puts value embeddings on layer 1 only), vocab a multiple of 64
# (nanochat pads the vocab to one).
TINY = dict(layout="nanochat", n_layers=2, n_heads=2, d_model=64, seq_len=32, batch=2, vocab=512, rounds=3,
            budget_s=None, warmup=1)
FAST = ["--shapes", "nanochat", "--rounds", "3", "--warmup", "1", "--threads", "1", "--peak-n", "256"]


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()  # the bench sets the process's thread count
    yield
    torch.set_num_threads(n)


def test_missing_checkout_prints_how_to_get_one_and_exits_0(tmp_path, capsys):
    out = tmp_path / "tt.json"
    missing = tmp_path / "no-such-dir"
    assert train_throughput.main([*FAST, "--nanochat", str(missing), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    skipped = json.loads(out.read_text())["results"]["nanochat"]["skipped"]
    assert str(missing) in skipped and CLONE in skipped and CLONE in printed
    assert "nanochat/gpt.py" in skipped


def test_lmforge_side_has_nanochats_matmul_shapes():
    cfg = nanochat_ref.lmforge_config(n_layers=4, n_heads=4, d_model=256, seq_len=256, vocab=8192)
    d, V = cfg.d_model, cfg.vocab_size
    assert (cfg.mlp, cfg.resolved_d_ff, cfg.qk_norm, cfg.tie_embeddings, cfg.bias) == ("gelu", 4 * d, True,
                                                                                        False, False)
    # Per block: q, k, v, o (4 d^2) and the MLP's d -> 4d -> d (8 d^2), nanochat's shapes; plus the
    # untied head. Norm weights (attn, mlp, q, k per block; final) are all lmforge adds.
    norms = cfg.n_layers * 4 * d + d
    assert count_params(cfg) == 2 * V * d + cfg.n_layers * 12 * d * d + norms


@pytest.mark.skipif(NANOCHAT is None, reason=f"no nanochat checkout ({nanochat_ref.ENV})")
def test_nanochat_row_runs_at_a_tiny_shape(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(train_throughput.SHAPES, "nanochat", TINY)
    dtype_env = os.environ.get("NANOCHAT_DTYPE")
    handlers = list(logging.getLogger().handlers)
    out = tmp_path / "tt.json"
    assert train_throughput.main([*FAST, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())["results"]["nanochat"]
    # The bench's import of nanochat leaves the process's env and root logging as they were.
    assert os.environ.get("NANOCHAT_DTYPE") == dtype_env and logging.getLogger().handlers == handlers

    d, V, L = TINY["d_model"], TINY["vocab"], TINY["n_layers"]
    assert r["baseline"] == "nanochat" and r["rounds"] == 3
    assert r["shape"] == dict(n_layers=L, n_heads=2, d_model=d, d_ff=4 * d, seq_len=32, batch=2, vocab=V)
    # nanochat: wte + lm_head + one value embedding (layer 1), 12 d^2 per block, the value gate
    # (12 channels -> n_kv_head) on layer 1, and its scalars: resid and x0 lambdas per layer, smear
    # gate (24 -> 1), smear and backout lambdas.
    nano_params = 3 * V * d + L * 12 * d * d + 12 * 2 + 2 * L + 24 + 2
    assert r["params_per_side"] == {"lmforge": r["params"], "nanochat": nano_params}
    check = r["initial_loss_check"]
    assert check["ln_vocab"] == pytest.approx(math.log(V))
    # nanochat's head starts at std 1e-3: its logits are ~0 and its loss is ln V.
    assert abs(check["loss_nanochat"] - math.log(V)) < 1e-2
    assert abs(check["loss_lmforge"] - math.log(V)) < 0.5
    sides = r["sides"]
    for side in ("lmforge", "nanochat"):
        s = sides[side]
        assert len(s["raw_step_s"]) == 3 and all(math.isfinite(v) for v in s["losses"])
        assert s["tokens_per_s"] == pytest.approx(2 * 32 / (s["median_ms"] / 1e3))
    assert r["ratio"] == pytest.approx(sides["nanochat"]["median_ms"] / sides["lmforge"]["median_ms"])
    assert r["compile_s"]["nanochat"] > 0  # its first step, which compiles its optimizer kernels
    table = [line.split("|")[1].strip() for line in printed.splitlines() if line.startswith("|")]
    assert "nanochat" in table
