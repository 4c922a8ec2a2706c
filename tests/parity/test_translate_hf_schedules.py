"""A TrainingArguments schedule, translated (config/translate_hf.py), gives the lr HF's Trainer would use at
every step: transformers' `get_scheduler` with the Trainer's warm-up rule (`get_warmup_steps`) is the
reference. Tolerance as tests/parity/test_schedules_vs_transformers.py (rel 1e-12)."""

from __future__ import annotations

import pytest
import torch

from lmforge.config.translate import apply_translation
from lmforge.config.translate_hf import translate_hf_args
from lmforge.optim.schedule import make_schedule

transformers = pytest.importorskip("transformers")

PEAK, STEPS = 2e-3, 120


def reference(args: dict) -> list[float]:
    ta = transformers.TrainingArguments(output_dir="unused", report_to="none", use_cpu=True, **args)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=ta.learning_rate)
    sched = transformers.get_scheduler(ta.lr_scheduler_type, opt, num_warmup_steps=ta.get_warmup_steps(STEPS),
                                       num_training_steps=STEPS,
                                       scheduler_specific_kwargs=ta.lr_scheduler_kwargs)
    out = []
    for _ in range(STEPS):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def translated(args: dict) -> list[float]:
    cfg = apply_translation(translate_hf_args(args, "args.json", 1), None, [])
    assert cfg.train.max_steps == STEPS
    lr_at = make_schedule(cfg.schedule, cfg.optim.lr, STEPS, STEPS * 2048)
    return [lr_at(s, s * 2048) for s in range(STEPS)]


@pytest.mark.parametrize("kind,warmup,kwargs", [
    ("linear", 10, {}), ("linear", 0.1, {}), ("cosine", 12, {}), ("cosine", 0, {}), ("constant", 0, {}),
    ("constant_with_warmup", 0.25, {}), ("inverse_sqrt", 10, {}), ("inverse_sqrt", 10, {"timescale": 30}),
    ("polynomial", 10, {}), ("polynomial", 10, {"power": 2.0, "lr_end": 1e-4}),
    ("cosine_with_min_lr", 10, {"min_lr_rate": 0.1}), ("cosine_with_min_lr", 10, {"min_lr": 2e-4}),
    ("warmup_stable_decay", 10, {"num_decay_steps": 30}),
    ("warmup_stable_decay", 10, {"num_decay_steps": 30, "decay_type": "linear", "min_lr_ratio": 0.05}),
])
def test_translated_schedule_equals_the_trainers(kind, warmup, kwargs):
    args = {"learning_rate": PEAK, "max_steps": STEPS, "lr_scheduler_type": kind, "warmup_steps": warmup,
            "lr_scheduler_kwargs": kwargs}
    assert translated(args) == pytest.approx(reference(args), rel=1e-12, abs=0.0)
