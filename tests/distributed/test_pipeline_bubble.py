"""logging.monitor.pipeline_bubble on 2 gloo ranks with parallel.pp=2 (GPipe): the logged idle share is in
(0, 1) and follows GPipe's (p-1)/(m+p-1), larger with 2 micro-batches than with 8; with the metric off no
stage method is wrapped (nothing is timed); without a pipeline the key is refused.

The ranks run this file as a script (run_ranks: torchrun's environment, no agent), each building the
pipeline and the Monitor the Trainer builds, so one start-up of torch serves both micro-batch counts."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

SCHEDULE = "gpipe"
STEPS = 6


def _worker(out_dir: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from dist_harness import CPU, global_batches, make_config

    from lmforge.engine.objectives import build_objective
    from lmforge.engine.precision import Precision
    from lmforge.models import build_model
    from lmforge.optim.builder import build_optimizer
    from lmforge.parallel.api import parallelize
    from lmforge.parallel.dims import ParallelDims
    from lmforge.parallel.pipeline_timing import _STAGE_WORK
    from lmforge.parallel.process_group import init_distributed, shutdown
    from lmforge.train.monitor import Monitor

    world = init_distributed(timeout_s=300)
    out: dict = {}
    for m, on in ((2, False), (2, True), (16, True)):
        # Work per micro-batch well above the per-chunk send/receive (with the tiny shape the fixed
        # per-chunk cost made 8 micro-batches idle more than 2).
        spec = {"parallel": {"pp": 2, "dp_shard": 1, "pp_schedule": SCHEDULE}, "rows": 8,
                "model": {"d_model": 256, "n_heads": 4, "n_kv_heads": 2}, "train": {"grad_accum_steps": m}}
        cfg = make_config(spec)
        cfg = cfg.model_copy(update={"logging": cfg.logging.model_copy(update={
            "monitor": cfg.logging.monitor.model_copy(update={"pipeline_bubble": on})})})
        dims = ParallelDims.resolve(cfg.parallel, world.world_size, cfg.model, m)
        dims.build_mesh("cpu")
        torch.manual_seed(0)
        pm = parallelize(build_model(cfg.model), cfg, dims, "fp32", build_objective(cfg))
        opt = pm.wrap_optimizer(build_optimizer(pm.model, cfg.optim))
        monitor = Monitor(cfg, pm.model, pm.comm, CPU, dims, pm.pipeline)
        stage = pm.pipeline.schedule._stage
        wrapped = sorted(n for n in (*_STAGE_WORK, "step", "_compute_loss")
                         if n in vars(stage) or n in vars(pm.pipeline.schedule))
        bubbles = []
        for step in range(STEPS + 1):
            pm.step(global_batches(spec, step, m, cfg.model.vocab_size), opt, Precision("fp32", CPU),
                    grad_clip=1.0)
            record = monitor.collect(tokens_per_s=1.0)
            if step:  # step 0 warms up (first-call shape exchange between the stages)
                bubbles.append(record.get("pipeline_bubble"))
        out[f"m={m} on={on}"] = {"wrapped": wrapped, "bubbles": bubbles}
    shutdown()
    Path(out_dir, f"rank{world.rank}.json").write_text(json.dumps(out))


@pytest.mark.slow  # two ranks building three pipelines: ~20 s on 2 busy cores
def test_bubble_is_logged_and_follows_the_micro_batch_count(tmp_path):
    from dist_harness import SRC

    from lmforge.parallel.local_ranks import run_ranks

    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    t0 = time.perf_counter()
    run_ranks(2, [sys.executable, __file__, str(tmp_path)], tmp_path, env, timeout=300)
    assert time.perf_counter() - t0 < 300
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for res in ranks:
        off = res["m=2 on=False"]
        assert off["wrapped"] == [] and off["bubbles"] == [None] * STEPS  # nothing timed, nothing logged
        assert res["m=2 on=True"]["wrapped"] == ["_compute_loss", "backward_one_chunk",
                                                "backward_weight_one_chunk", "forward_one_chunk", "step"]
    # every rank logs the same value (the mean over ranks)
    assert ranks[0]["m=2 on=True"]["bubbles"] == ranks[1]["m=2 on=True"]["bubbles"]
    few, many = (sorted(ranks[0][f"m={m} on=True"]["bubbles"]) for m in (2, 16))
    assert all(0 < b < 1 for b in few + many), (few, many)
    # medians: GPipe's (p-1)/(m+p-1) is 1/3 at m=2 and 1/17 at m=16
    assert few[STEPS // 2] > many[STEPS // 2], (few, many)


def test_refused_without_a_pipeline(tiny_cfg):
    from lmforge.engine.comm import LOCAL
    from lmforge.errors import ConfigError
    from lmforge.models import build_model
    from lmforge.train.monitor import Monitor

    cfg = tiny_cfg("logging.monitor.pipeline_bubble=true", "model.vocab_size=128")
    with pytest.raises(ConfigError, match=r"pipeline_bubble=true .* parallel.pp > 1, or set "
                       r"logging.monitor.pipeline_bubble=false"):
        Monitor(cfg, build_model(cfg.model), LOCAL, torch.device("cpu"))


if __name__ == "__main__":
    _worker(sys.argv[1])
