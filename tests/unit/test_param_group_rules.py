"""optim.param_groups: per-module weight decay and lr multipliers by parameter-name glob. The reference
is torch.optim with the param groups a user would build by hand; the rules compose with the no-decay
split, the schedule (the multiplier scales the scheduled lr) and every optimizer lmforge has."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from lmforge.config.optim import OPTIMIZER_CONFIGS, optim_config
from lmforge.config.train import ScheduleConfig
from lmforge.errors import CheckpointMismatchError, ConfigError
from lmforge.optim.builder import GroupLayout, build_optimizer, param_groups, param_name
from lmforge.optim.schedule import LRSchedule


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 6)])
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 11, bias=False)

    def forward(self, x):
        return self.out(self.norm(torch.tanh(self.layers[0](self.emb(x)))))


def tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, schedule: LRSchedule | None = None):
    for s in range(steps):
        if schedule is not None:
            schedule.apply(opt, s, 0)
        g = torch.Generator().manual_seed(100 + s)
        x, y = torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()


RULES = [{"match": "norm.*", "weight_decay": 0.3}, {"match": "emb*", "lr_scale": 0.1},
         {"match": "layers.*", "lr_scale": 2.0, "weight_decay": 0.0}]


def test_rules_equal_hand_built_torch_groups_through_a_schedule():
    """AdamW with the rules, under a warm-up + cosine schedule, equals torch.optim.AdamW over the groups
    a user writes by hand (each group's lr = peak x multiplier x the schedule's factor), bit for bit."""
    a, b = tiny(), tiny()
    cfg = optim_config(name="adamw", lr=1e-2, weight_decay=0.05, fused=False, param_groups=RULES)
    ours = build_optimizer(a, cfg)
    ref = torch.optim.AdamW([
        {"params": [b.out.weight], "weight_decay": 0.05},            # default decay
        {"params": [b.norm.weight, b.norm.bias], "weight_decay": 0.3},  # rule 0: its decay wins
        {"params": [b.emb.weight], "weight_decay": 0.0, "lr": 1e-3},  # rule 1: embeddings stay undecayed
        {"params": [b.layers[0].weight], "weight_decay": 0.0, "lr": 2e-2},  # rule 2
        {"params": [b.layers[0].bias], "weight_decay": 0.0, "lr": 2e-2},
    ], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=False)
    assert [g["name"] for g in ours.param_groups] == ["decay", "rule0_no_decay", "rule1_no_decay",
                                                      "rule2_decay", "rule2_no_decay"]
    sched = ScheduleConfig(name="cosine", warmup_steps=3)
    train(a, ours, 8, LRSchedule(sched, ours, 1e-2, 8, 0, None))
    train(b, ref, 8, LRSchedule(sched, ref, 1e-2, 8, 0, None))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert ours.param_groups[2]["lr"] == pytest.approx(ours.param_groups[0]["lr"] * 0.1, rel=1e-12)


def test_no_rules_keeps_the_groups_as_they_were():
    m = tiny()
    groups = param_groups(m, 0.1)
    assert [(g["name"], len(g["params"]), g["weight_decay"]) for g in groups] == [("decay", 2, 0.1),
                                                                               ("no_decay", 4, 0.0)]
    assert all("lr_scale" not in g for g in groups)


def test_first_matching_rule_wins():
    m = tiny()
    rules = optim_config(name="adamw", param_groups=[{"match": "layers.0.weight", "lr_scale": 3.0},
                                                     {"match": "layers.*", "lr_scale": 5.0}]).param_groups
    by_name = {g["name"]: g for g in param_groups(m, 0.1, rules)}
    r0, r1 = by_name["rule0_decay"], by_name["rule1_no_decay"]
    assert r0["params"] == [m.layers[0].weight] and r0["lr_scale"] == 3.0
    assert r1["params"] == [m.layers[0].bias] and r1["lr_scale"] == 5.0


def test_a_rule_that_matches_nothing_is_named():
    rules = optim_config(name="adamw", param_groups=[{"match": "layers.*", "lr_scale": 2.0},
                                                     {"match": "*.attn.*", "lr_scale": 2.0}]).param_groups
    with pytest.raises(ConfigError, match=r"optim.param_groups\[1\].match='\*.attn.\*' matches no trainable "
                                          r"parameter.*emb.weight"):
        param_groups(tiny(), 0.1, rules)
    shadowed = optim_config(**{"name": "adamw", "param_groups": [{"match": "*", "lr_scale": 2.0},
                                                               {"match": "layers.*", "lr_scale": 2.0}]})
    with pytest.raises(ConfigError, match=r"param_groups\[1\].*only ones an earlier rule took"):
        param_groups(tiny(), 0.1, shadowed.param_groups)


@pytest.mark.parametrize("rule, msg", [
    ({"match": "x" * 257, "lr_scale": 2.0}, "at most 256 characters"),
    ({"match": "", "lr_scale": 2.0}, "at least 1 character"),
    ({"match": "layers.*"}, "changes nothing"),
    ({"match": "layers.*", "lr_scale": 0}, "greater than 0"),
    ({"match": "layers.*", "weight_decay": -1}, "greater than or equal to 0"),
    ({"match": "layers.*", "lr": 2}, "Extra inputs|lr"),
])
def test_bad_rules_are_refused(rule, msg):
    with pytest.raises(ValidationError, match=msg):
        optim_config(**{"name": "adamw", "param_groups": [rule]})


def test_the_number_of_rules_is_bounded():
    with pytest.raises(ValidationError, match="at most 64"):
        optim_config(name="adamw", param_groups=[{"match": f"x{i}", "lr_scale": 2.0} for i in range(65)])


def test_wrapper_parts_are_not_part_of_the_names():
    wrapped = "module.layers.0._checkpoint_wrapped_module.attn.wq.weight"
    assert param_name(wrapped) == "layers.0.attn.wq.weight"
    assert param_name("_orig_mod.tok_embeddings.weight") == "tok_embeddings.weight"
    assert param_name("layers.module.x") == "layers.module.x"  # a user's own submodule named "module" stays


@pytest.mark.parametrize("name", sorted(OPTIMIZER_CONFIGS))
def test_every_optimizer_takes_the_rules(name):
    """Each optimizer builds with the rules; every group's lr is its unscaled twin's x the multiplier and
    its weight decay the rule's; Adafactor's relative step (no lr to scale) is refused."""
    extra = {"adafactor": {"adafactor": {"relative_step": False}}}.get(name, {})
    rules = [{"match": "layers.*", "lr_scale": 0.5, "weight_decay": 0.2}]
    plain = build_optimizer(tiny(), optim_config(**{"name": name, "lr": 1e-3, **extra}))
    ruled = build_optimizer(tiny(), optim_config(name=name, lr=1e-3, param_groups=rules, **extra))
    base = {g.get("use_muon", False): g["lr"] for g in plain.param_groups}
    lin = [g for g in ruled.param_groups if g["name"].startswith(("rule0", "muon_rule0"))]
    assert lin and all(g["lr"] == pytest.approx(base[g.get("use_muon", False)] * 0.5) for g in lin)
    assert all(g["weight_decay"] == 0.2 for g in lin)
    if name == "adafactor":
        with pytest.raises(ConfigError, match="relative_step"):
            build_optimizer(tiny(), optim_config(**{"name": name, "param_groups": rules,
                                                    "adafactor": {"relative_step": True}}))


def test_group_layout_refuses_other_groups_on_resume():
    m = tiny()
    saved = GroupLayout(build_optimizer(m, optim_config(**{"name": "adamw"}))).state_dict()
    same = GroupLayout(build_optimizer(m, optim_config(**{"name": "adamw"})))
    same.load_state_dict(copy.deepcopy(saved))
    other = GroupLayout(build_optimizer(m, optim_config(**{"name": "adamw", "param_groups": RULES})))
    with pytest.raises(CheckpointMismatchError, match=r"param groups \[\['decay', 2\], \['no_decay', 4\]\].*"
                                                      r"rule0_no_decay"):
        other.load_state_dict(saved)
