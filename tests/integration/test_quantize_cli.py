"""`lmforge quantize` end to end on the tiny model: int8 and int4 (RTN and GPTQ) run dirs that
`lmforge generate` / `eval` / `export` load, logits within the documented bounds, files the measured
fraction of bf16, refusal to train, and bad inputs as clear errors (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import TINY, tiny_overrides
from lmforge.checkpoint.safe_dcp import read_metadata
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.eval.open_run import load_run
from lmforge.models.quant import QuantEmbedding, QuantLinear
from lmforge.train.trainer import Trainer

# The documented bounds: the mean |logit difference| from the source as a fraction of the source logits'
# std, on validation text. Measured on this tiny model (30 steps): int8 0.044%, int4 g32 RTN 0.12%, GPTQ
# (asymmetric) 0.05%; the bounds leave ~3x. (The demo model, trained longer, measures larger: README.)
# With the embedding table quantized too, a tied output head multiplies by int4 weights as well: 1.3%.
BOUNDS = {"int8": 0.0015, "int4": 0.004, "int4+embeddings": 0.04}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_data_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantize")
    cfg = load_config(TINY, tiny_overrides(root / "run", shared_data_dir, "train.max_steps=30",
                                           "train.eval_every=30", "checkpoint.every=30"))
    Trainer(cfg).fit()
    out = {"src": root / "run"}
    for name, args in {"int8": ["--bits", "8"],
                       "int4": ["--bits", "4", "--group-size", "32"],
                       "int4e": ["--bits", "4", "--group-size", "32", "--quantize-embeddings"],
                       "gptq": ["--bits", "4", "--group-size", "32", "--method", "gptq", "--asymmetric",
                                "--calib-samples", "16", "--calib-seq-len", "64"]}.items():
        out[name] = root / name
        assert main(["quantize", str(root / "run"), str(out[name]), *args]) == 0
    return out


def _val_ids(run) -> torch.Tensor:
    from lmforge.data.prepare import data_dir, load_prepared
    from lmforge.data.shards import open_shard

    data = load_prepared(data_dir(run.cfg))
    stream = torch.from_numpy(open_shard(data.shards("val")[0])[: 4 * 64].astype("int64"))
    return stream.view(4, 64)


def test_quantized_runs_load_and_logits_within_bounds(runs):
    src = load_run(runs["src"])
    ids = _val_ids(src)
    with torch.no_grad():
        ref = src.model(ids)
        for name, bound in [("int8", BOUNDS["int8"]), ("int4", BOUNDS["int4"]), ("gptq", BOUNDS["int4"])]:
            run = load_run(runs[name])
            layers = [m for m in run.model.modules() if isinstance(m, QuantLinear)]
            assert len(layers) == 14 and all(m.bits == (8 if name == "int8" else 4) for m in layers)
            got = run.model(ids)
            rel = (got - ref).abs().mean() / ref.std()
            assert 0 < rel < bound, (name, float(rel))
            report = json.loads((runs[name] / "quantize.json").read_text())
            assert report["logits"]["mean_rel"] < bound
            # the logits the report measured are those of the model as it loads
            assert report["method"] == ("gptq" if name == "gptq" else "rtn")


def test_file_sizes_against_bf16(runs, tmp_path):
    """Measured on files: the quantized layers saved alone (safetensors) against the same weights in bf16;
    and what the checkpoint stores each tensor as."""
    src = load_run(runs["src"]).model
    names = [n for n, m in load_run(runs["int4"]).model.named_modules() if isinstance(m, QuantLinear)]
    save_file({n: src.get_submodule(n).weight.detach().bfloat16().contiguous() for n in names},
              tmp_path / "bf16.safetensors")
    bf16 = (tmp_path / "bf16.safetensors").stat().st_size
    for name, lo, hi in [("int8", 1.9, 2.0), ("int4", 3.4, 3.6)]:  # theory: 1.94 (K=64) / 3.56 (g32)
        model = load_run(runs[name]).model
        save_file({f"{n}.{k}": v for n in names for k, v in model.get_submodule(n).state_dict().items()},
                  tmp_path / f"{name}.safetensors")
        ratio = bf16 / (tmp_path / f"{name}.safetensors").stat().st_size
        assert lo < ratio < hi, (name, ratio)
        # the checkpoint stores the integers packed and every float (scales, embeddings, norms) in bf16
        state = next((runs[name] / "checkpoints").glob("step_*/state"))
        stored = {k[len("model."):]: m.properties.dtype
                  for k, m in read_metadata(str(state)).state_dict_metadata.items() if k.startswith("model.")}
        assert stored == {k: torch.bfloat16 if t.is_floating_point() else t.dtype
                          for k, t in model.state_dict().items()}
        assert stored[f"{names[0]}.qweight"] == (torch.int8 if name == "int8" else torch.uint8)
        # the report counts tensor bytes (no file headers): 16 bits against bits + 16 / group per weight
        layers = [model.get_submodule(n) for n in names]
        theory = sum(2 * m.in_features * m.out_features for m in layers) / sum(
            m.in_features * m.out_features * m.bits / 8 + 2 * m.scale.numel() for m in layers)
        report = json.loads((runs[name] / "quantize.json").read_text())
        assert report["layer_ratio"] == pytest.approx(theory, rel=1e-3)


def test_quantized_embeddings_make_the_whole_file_about_4x_smaller(runs):
    """With the embedding table quantized too, the whole model's tensors (not only the linear layers)
    shrink by about 3.5x against bf16 (g32: 16 / (4 + 16 / 32) = 3.56x per weight, less the norms kept in
    bf16). The tiny model's checkpoint files are dominated by fixed metadata, so the tensors are counted
    (the demo model's files: 3.55x, README)."""
    plain = json.loads((runs["int4"] / "quantize.json").read_text())
    both = json.loads((runs["int4e"] / "quantize.json").read_text())
    assert "tok_embeddings" in both["layers"] and plain["ratio"] < both["ratio"]
    run = load_run(runs["int4e"])
    stored = sum(t.numel() * (2 if t.is_floating_point() else t.element_size())
                 for t in run.model.state_dict().values())
    assert both["bf16_bytes"] == plain["bf16_bytes"] and 3.3 < both["bf16_bytes"] / stored < 3.56
    assert isinstance(run.model.tok_embeddings, QuantEmbedding)
    src = load_run(runs["src"]).model
    ids = _val_ids(run)
    with torch.no_grad():
        ref, got = src(ids), run.model(ids)
    assert 0 < float((got - ref).abs().mean() / ref.std()) < BOUNDS["int4+embeddings"]


def test_generate_eval_export_work_on_quantized_run(runs, tmp_path, capsys):
    assert main(["generate", str(runs["int4"]), "--prompt", "def", "--set", "generate.max_new_tokens=8",
                 "--set", "generate.num_samples=1"]) == 0
    assert main(["eval", str(runs["int4"]), "--set", "eval.max_batches=2"]) == 0
    assert main(["export", str(runs["int4"]), str(tmp_path / "hf")]) == 0
    assert "dequantized" in capsys.readouterr().out
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    run = load_run(runs["int4"])
    ids = _val_ids(run)
    with torch.no_grad():
        ours, theirs = run.model(ids), hf(ids).logits
    assert (ours - theirs).abs().max() < 1e-4


def test_quantized_run_refuses_training(runs, capsys):
    code = main(["train", "-c", str(runs["int4"] / "config.yaml"), "--set", "logging.progress=none"])
    assert code == 2
    assert "quantized" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--bits", "3"], "--bits 3 is not supported; valid: 4 or 8"),
    (["--bits", "4", "--group-size", "48"], "does not divide the 64 inputs of layers.0.attn.wq"),
    (["--method", "awq"], "--method 'awq' is not supported"),
])
def test_bad_arguments_exit_2(runs, tmp_path, capsys, args, message):
    assert main(["quantize", str(runs["src"]), str(tmp_path / "out"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_output_dir_and_source_checks(runs, tmp_path, capsys):
    out = tmp_path / "full"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["quantize", str(runs["src"]), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert main(["quantize", str(runs["int4"]), str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err
