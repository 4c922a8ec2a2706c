"""The parts of objective gkd around its loss: where a conversation's prompt ends (packed and unpacked
rows), the rows of sampled completions and their targets, the seeded on-policy draw, a training batch
keeping its seed on its way to a device, and the gkd section's bounds."""

from __future__ import annotations

import pytest
import torch

from lmforge.assembly.methods.gkd import prompts_of, rows
from lmforge.config.schema import Config
from lmforge.data.batch import IGNORE_INDEX, ChatBatch
from lmforge.engine.objectives.gkd import GKDBatch, on_policy_draw
from lmforge.errors import ConfigError

X = IGNORE_INDEX


def test_a_prompt_ends_where_the_last_run_of_targets_begins():
    # packed row: conversation 0 = [1..8] with two assistant turns (targets at 2-3 and 5-6),
    # conversation 1 = [20..24] with one (targets at 10-11), then padding
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23, 24, 0, 0]])
    targets = torch.tensor([[X, X, 4, 5, X, 7, 8, X, X, X, 23, 24, X, X, X]])
    seg = torch.tensor([[0] * 8 + [1] * 5 + [-1] * 2])
    pos = torch.tensor([list(range(8)) + list(range(5)) + [0, 0]])
    packed = ChatBatch(ids, targets, pos, seg, real_tokens=13)
    # conversation 0: position 5 predicts its last turn's first token (7); conversation 1: position 10
    assert prompts_of(packed) == [[1, 2, 3, 4, 5, 6], [20, 21, 22]]
    unpacked = ChatBatch(torch.tensor([[1, 2, 3, 4, 0], [5, 6, 7, 0, 0]]),
                         torch.tensor([[X, 3, 4, X, X], [X, X, X, X, X]]), real_tokens=7)
    assert prompts_of(unpacked) == [[1, 2]]  # a conversation without targets has nothing to replace


def test_sampled_rows_target_the_completion_only():
    batch = rows([[1, 2, 3], [4]], [[7, 8], [9, 10, 11]], pad_id=0, device=torch.device("cpu"))
    assert batch.input_ids.tolist() == [[1, 2, 3, 7, 8], [4, 9, 10, 11, 0]]
    assert batch.targets.tolist() == [[X, X, 7, 8, X], [9, 10, 11, X, X]]
    assert batch.target_count() == 5 and batch.n_targets == 5 and batch.real_tokens == 9


def test_the_draw_is_seeded_and_lands_at_lmbda():
    draws = [on_policy_draw(seed, 0.3) for seed in range(2000)]
    assert draws == [on_policy_draw(seed, 0.3) for seed in range(2000)]
    assert 0.26 < sum(draws) / len(draws) < 0.34
    assert not any(on_policy_draw(s, 0.0) for s in range(200))
    assert all(on_policy_draw(s, 1.0) for s in range(200))


def test_a_training_batch_keeps_its_seed():
    b = GKDBatch(torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), X), real_tokens=6, seed=41)
    moved = b.to("cpu")
    assert isinstance(moved, GKDBatch) and moved.seed == 41 and not moved.sampled


@pytest.mark.parametrize("key,value", [("beta", 1.5), ("lmbda", -0.1), ("temperature", 0.0),
                                       ("max_new_tokens", 0), ("max_new_tokens", 100_000), ("tau", 1)])
def test_the_section_refuses_what_it_cannot_honour(key, value):
    from lmforge.config.load import validate_config

    with pytest.raises(ConfigError, match=f"gkd.{key}"):
        validate_config({"objective": {"name": "gkd"}, "gkd": {key: value}})
    assert Config(objective={"name": "gkd"}).gkd.lmbda == 0.5


def test_the_shipped_config_loads():
    from pathlib import Path

    from lmforge.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "gkd" / "lora.yaml")
    assert cfg.objective.name == "gkd" and cfg.gkd.teacher == "runs/sft-full" and cfg.gkd.lmbda == 0.5


def test_the_setup_refuses_layouts_and_settings_it_cannot_run(tmp_path):
    from types import SimpleNamespace

    from lmforge.assembly.methods.gkd import GKDSetup
    from lmforge.engine.objectives.gkd import GKD

    setup, teacher = GKDSetup(), str(tmp_path)
    for dims, lmbda, match in [((2, 1, False), 0.0, "not tensor or pipeline"),
                               ((1, 2, False), 0.0, "not tensor or pipeline"),
                               ((1, 1, True), 0.5, "not FSDP")]:
        objective = GKD(lmbda=lmbda)
        objective.teacher = lambda b: None  # handed over: only the layout is checked
        ctx = SimpleNamespace(dims=SimpleNamespace(tp=dims[0], pp=dims[1], fsdp=dims[2]))
        with pytest.raises(ConfigError, match=match):
            setup.attach(objective, ctx)
    with pytest.raises(ConfigError, match="sft.loss_on=all"):
        setup.check_inputs(Config(objective={"name": "gkd"}, gkd={"teacher": teacher},
                                  sft={"loss_on": "all"}))
    with pytest.raises(ConfigError, match="needs a teacher"):
        setup.check_inputs(Config(objective={"name": "gkd"}))
    setup.check_inputs(Config(objective={"name": "gkd"}, gkd={"teacher": teacher, "lmbda": 0.0},
                              sft={"loss_on": "all"}))  # off-policy: every token may be a target
