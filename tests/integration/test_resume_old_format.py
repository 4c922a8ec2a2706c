"""A run checkpointed by lmforge before the engine rework (format 2: one flat train-state dict, and a
config.yaml with the flat optim keys) still resumes, onto the curve a fresh run of today's code takes.

The fixture (tests/data/format2_run, see its README) was written on one machine; bit-exactness holds
only between runs on the same CPU model, so the continued curve is compared with a tolerance that a
wrong data position, lost optimizer moments or a reset schedule would break by orders of magnitude.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from lmforge.config import load_config
from lmforge.errors import LmforgeDeprecationWarning
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "data" / "format2_run"
CORPUS = REPO / "tests" / "data" / "pydoc_topics.jsonl"


def overrides(run: Path, data: Path, tokenizer: Path, steps: int) -> list[str]:
    # The corpus and tokenizer are the ones the fixture was prepared from, at this checkout's paths.
    return [
        f"run.dir={run}",
        f"data.dir={data}",
        f"data.sources=[{CORPUS}]",
        f"data.tokenizer.path={tokenizer}",
        f"train.max_steps={steps}",
        "logging.progress=none",
        "logging.plot=false",
    ]


def curve(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "loss" in r and "event" not in r}


def test_format2_run_resumes_as_todays_checkpoint_does(tmp_path):
    """The fixture trained 6 steps (schedule over 6) and is continued to 10; the reference is today's
    code doing the same: 6 steps, a checkpoint in today's format, resumed to 10."""
    run = tmp_path / "old"
    shutil.copytree(FIXTURE, run)
    tokenizer = run / "data" / "tokenizer.json"
    with pytest.warns(LmforgeDeprecationWarning, match="flat optim keys are deprecated"):
        cfg = load_config(run / "config.yaml", overrides(run, tmp_path / "data", tokenizer, 10))
    assert cfg.optim.name == "adamw"
    resumed = Trainer(cfg, resume=True)
    # Every part of the flat format-2 state landed where today's named parts keep it.
    assert resumed.step == 6 and resumed.tokens_seen == 6 * 4 * 32 * 2 and resumed.skipped_steps == 0
    assert resumed.lr_scale == 1.0 and resumed.guard.consecutive == 0
    assert resumed.run.train_loader.state_dict()["cursor"] == 12  # 6 steps x 2 micro-batches
    assert resumed.averages["ema"].n_averaged == 6
    # The checkpoint precedes the final evaluation at step 6: the best is the one at step 3.
    assert resumed.early.best_step == 3 and resumed.early.bad_evals == 0
    assert len(resumed.spikes.history) == 5  # the window (5) is full after 6 steps
    resumed.fit()

    fresh_dir = tmp_path / "fresh"
    with pytest.warns(LmforgeDeprecationWarning):
        Trainer(
            load_config(FIXTURE / "config.yaml", overrides(fresh_dir, tmp_path / "data", tokenizer, 6))
        ).fit()
        Trainer(load_config(FIXTURE / "config.yaml", overrides(fresh_dir, tmp_path / "data", tokenizer, 10)),
                resume=True).fit()
    old, new = curve(run), curve(fresh_dir)
    assert sorted(old) == sorted(new) == list(range(1, 11))  # steps 7-10 appended, none logged twice
    for step in range(1, 11):
        assert old[step]["lr"] == new[step]["lr"]  # a function of the step and the run length alone
        assert old[step]["tokens_seen"] == new[step]["tokens_seen"]
        # On the machine that wrote the fixture the curves are equal bit for bit; elsewhere the last
        # bits differ. A wrong data position or lost optimizer moments moves the loss by ~0.1.
        assert old[step]["loss"] == pytest.approx(new[step]["loss"], rel=1e-4, abs=1e-5), step
        assert old[step]["grad_norm"] == pytest.approx(new[step]["grad_norm"], rel=1e-3), step
    # The resumed run rewrote config.yaml in today's form: the optimizer's own keys, no flat ones.
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (
        saved["optim"]["name"] == "adamw"
        and "muon_lr" not in saved["optim"]
        and "momentum" not in saved["optim"]
    )
