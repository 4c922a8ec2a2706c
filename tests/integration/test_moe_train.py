"""`lmforge train -c configs/moe/tiny.yaml` end to end: the loss falls, the router's statistics reach
metrics.jsonl, a crashed run (bias balancing on, so the expert bias must come back from the checkpoint)
resumes bit for bit, and `lmforge export` writes a Mixtral dir transformers loads with equal logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import CORPUS, Crash, CrashAt
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer

MOE = Path(__file__).resolve().parents[2] / "configs" / "moe" / "tiny.yaml"
STATS = ("moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_load_min", "moe_drop_frac", "moe_router_entropy")
COMPARED = ("step", "loss", "grad_norm", "lr", "val_loss", *STATS)


def overrides(run: Path, data: Path, *extra: str) -> list[str]:
    return [f"run.dir={run}", f"data.dir={data}", f"data.sources=[{CORPUS}]", "data.max_chars=null",
            "logging.progress=none", "train.max_steps=12", "checkpoint.every=4", "train.eval_every=6", *extra]


def cli(run: Path, data: Path, *extra: str) -> list[str]:
    return ["-c", str(MOE), *sum((["--set", o] for o in overrides(run, data, *extra)), [])]


def curve(run: Path) -> list[dict]:
    return [{k: r[k] for k in COMPARED if k in r} for r in read_metrics(run / "metrics.jsonl")]


def test_moe_trains_logs_router_stats_resumes_exactly_and_exports(tmp_path, shared_data_dir):
    extra = ("model.moe.bias_balancing=true", "model.moe.bias_update_rate=0.01",
             "model.moe.capacity_factor=1.5")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert main(["train", *cli(straight, shared_data_dir, *extra)]) == 0
    rows = [r for r in read_metrics(straight / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 12
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5  # it learns
    for r in rows:
        assert set(STATS) <= set(r)
        assert r["moe_load_min"] <= 1.0 <= r["moe_load_max"]  # shares times E / top_k straddle uniform
        assert 0.0 <= r["moe_drop_frac"] < 0.5
    # At init the router is near uniform: balance loss ~ top_k = 2, entropy ~ ln 4 (its maximum).
    assert rows[0]["moe_aux_loss"] == pytest.approx(2.0, abs=0.02)
    assert all(0 < r["moe_router_entropy"] <= 1.3863 for r in rows)
    assert rows[0]["moe_router_entropy"] == pytest.approx(1.3863, abs=0.02)

    config = load_config(MOE, overrides(crashed, shared_data_dir, *extra))
    with pytest.raises(Crash):
        Trainer(config, callbacks=[CrashAt(6)]).fit()  # after checkpoint 4: steps 5-6 are redone
    assert main(["train", *cli(crashed, shared_data_dir, *extra), "--resume"]) == 0
    assert curve(straight) == curve(crashed)  # exact: losses, router stats and validation

    # Export: bias balancing has no place in Mixtral's config, so export a run trained without it.
    plain = tmp_path / "plain"
    assert main(["train", *cli(plain, shared_data_dir, "train.max_steps=4", "train.eval_every=0")]) == 0
    assert main(["export", str(plain), str(tmp_path / "hf")]) == 0
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    from lmforge.eval.open_run import load_run

    run = load_run(plain)
    ids = torch.randint(0, run.cfg.model.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, run.model.eval()(ids), rtol=0, atol=1e-5)
    assert main(["export", str(straight), str(tmp_path / "hf2")]) == 2  # bias balancing: a clear refusal
