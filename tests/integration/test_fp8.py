"""train.fp8 (engine/fp8.py): refused off a CUDA GPU of compute capability >= 8.9 and with what it cannot
compose with, before any work; on a CPU the real conversion runs with torchao's emulation (FP8 rounding in
plain matmuls, the test hook EMULATE_FOR_TESTS): it converts the blocks' Linear layers, trains with finite
losses, resumes bit for bit and exports a plain Hugging Face model."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import TINY, Crash, CrashAt, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.engine import fp8
from lmforge.errors import ConfigError
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer

STEPS = 6


def overrides(run, data, *extra):
    return tiny_overrides(run, data, f"train.max_steps={STEPS}", "train.precision=bf16",
                          "train.fp8=tensorwise", "train.eval_every=0", "train.eval_batches=1",
                          "checkpoint.every=3",
                          "train.grad_accum_steps=1", *extra)


def test_refused_on_a_cpu_before_any_work(tmp_path, shared_data_dir, capsys):
    run = tmp_path / "run"
    sets = sum((["--set", o] for o in overrides(run, shared_data_dir)), [])
    assert main(["train", "-c", str(TINY), *sets]) == 2
    err = capsys.readouterr().err
    assert "train.fp8=tensorwise: FP8 training needs a CUDA GPU of compute capability 8.9" in err
    assert not run.exists()


@pytest.mark.parametrize("extra,message", [
    ("train.precision=fp32", "train.precision=fp32 cannot run it"),
    ("finetune.method=lora", "wraps with adapters"),
    ("parallel.tp=2", "tensor parallelism"),
])
def test_what_it_cannot_compose_with_is_refused(tmp_path, shared_data_dir, monkeypatch, extra, message):
    monkeypatch.setattr(fp8, "EMULATE_FOR_TESTS", True)  # past the device check
    cfg = load_config(TINY, overrides(tmp_path / "run", shared_data_dir, extra))
    with pytest.raises(ConfigError, match=message):
        fp8.check_fp8(cfg, torch.device("cpu"))


def test_emulated_fp8_trains_resumes_bit_for_bit_and_exports(tmp_path, shared_data_dir, monkeypatch):
    from torchao.float8.float8_linear import Float8Linear

    monkeypatch.setattr(fp8, "EMULATE_FOR_TESTS", True)
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    trainer = Trainer(load_config(TINY, overrides(straight, shared_data_dir)))
    converted = {n for n, m in trainer.model.named_modules() if isinstance(m, Float8Linear)}
    assert converted and all(n.startswith("layers.") for n in converted)
    assert not any(isinstance(m, torch.nn.Linear) and not isinstance(m, Float8Linear)
                   for n, m in trainer.model.named_modules() if n.startswith("layers."))
    trainer.fit()
    with pytest.raises(Crash):
        Trainer(load_config(TINY, overrides(crashed, shared_data_dir)), callbacks=[CrashAt(4)]).fit()
    Trainer(load_config(TINY, overrides(crashed, shared_data_dir)), resume=True).fit()
    curve = lambda d: [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(d / "metrics.jsonl")  # noqa: E731
                       if "loss" in r]
    assert len(curve(straight)) == STEPS and curve(straight) == curve(crashed)
    assert all(math.isfinite(loss) for _, loss, _ in curve(straight))
    assert main(["export", str(straight), str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(math.isfinite(float(p.sum())) for p in hf.parameters())
