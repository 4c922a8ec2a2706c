"""`lmforge sft --budget`'s pure choice (tools/sft_planner.py) on fake throughput tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.errors import ConfigError
from lmforge.tools import sft_planner as S

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
# the demo base (d256-L4, ~4.5M parameters) and generated task data (short conversations)
DEMO = S.ModelFacts(params=4_500_000, d_model=256, n_layers=4, max_seq_len=256)
TASKS = S.DataFacts(examples=4000, tokens=160_000, length_q=57, max_length=70, prepare_s=1.0,
                    exact_records=240)


def table(full=3000.0, lora=4000.0, memory=8 * GIB, spent=3.0, device="cpu") -> S.SftThroughput:
    tps = {k: v for k, v in (("full", full), ("lora", lora)) if v is not None}
    return S.SftThroughput(device, tps, micro=32, seq=64, memory_bytes=memory, spent_s=spent)


def test_plan_chooses_from_the_table_and_says_why():
    p = S.plan_sft(120, table(), DEMO, TASKS, {})
    s, why = p.settings, {c.key: c.why for c in p.choices}
    assert s["train.seq_len"] == 64 and "99%" in why["train.seq_len"]  # 57 tokens rounded up to 16
    assert s["train.micro_batch_size"] == S.MICRO_TOKENS["cpu"] // 64
    assert s["schedule.name"] == "wsd" and s["schedule.unit"] == "time"
    assert s["finetune.method"] == ("full" if S.FULL_BEATS_LORA else "lora")
    # the phases add up to the budget, and training gets most of it
    assert sum(p.phases.values()) == pytest.approx(120, abs=0.1)
    assert 0.7 * 120 < s["train.max_time"] < 120
    assert p.phases["exact match"] == pytest.approx(S.EXACT_SHARE * 120)
    assert "finetune.method" in p.table() and "| method | tokens/s |" in p.markdown()
    json.dumps(p.to_json())


def test_lora_where_full_does_not_fit_and_its_settings():
    p = S.plan_sft(120, table(memory=64 * 2**20), DEMO, TASKS, {})  # 64 MiB: full needs 72 MB
    s, why = p.settings, {c.key: c.why for c in p.choices}
    assert s["finetune.method"] == "lora" and "does not fit" in why["finetune.method"]
    assert s["finetune.r"] == S.LORA_R and s["finetune.alpha"] == 2 * S.LORA_R
    assert s["finetune.targets"] == ["all-linear"] and s["optim.lr"] == pytest.approx(S.LORA_LR)


def test_full_lr_follows_the_width():
    wide = S.ModelFacts(params=4_500_000, d_model=2 * S.RULES_WIDTH, n_layers=4, max_seq_len=256)
    s = S.plan_sft(120, table(), wide, TASKS, {"finetune.method": "full"}).settings
    assert s["optim.lr"] == pytest.approx(S.FULL_LR / 2)


def test_plan_is_deterministic():
    one, two = (S.plan_sft(90, table(), DEMO, TASKS, {}) for _ in range(2))
    assert one.to_json() == two.to_json()


@pytest.mark.parametrize("memory", [8 * GIB, 64 * 2**20])
def test_more_budget_never_fewer_steps(memory):
    steps = [S.plan_sft(b, table(memory=memory), DEMO, TASKS, {"finetune.method": m}).predicted["steps"]
             for m in ("lora", "full") if memory > GIB or m == "lora"
             for b in (30, 45, 60, 120, 300, 900, 3600)]
    for i in range(0, len(steps), 7):
        assert steps[i:i + 7] == sorted(steps[i:i + 7]) and steps[i] < steps[i + 6]
    free = [S.plan_sft(b, table(memory=memory), DEMO, TASKS, {}).predicted["steps"] for b in (60, 120, 600)]
    assert free == sorted(free)


def test_seq_len_from_the_data_within_the_base_context():
    long = S.DataFacts(examples=100, tokens=100_000, length_q=900, max_length=2000, prepare_s=1.0)
    s = S.plan_sft(300, table(), DEMO, long, {}).settings
    assert s["train.seq_len"] == DEMO.max_seq_len
    assert s["train.micro_batch_size"] == S.MICRO_TOKENS["cpu"] // 256
    short = S.DataFacts(examples=100, tokens=1_000, length_q=5, max_length=9, prepare_s=1.0)
    assert S.plan_sft(300, table(), DEMO, short, {}).settings["train.seq_len"] == S.MIN_SEQ


def test_user_keys_win_and_the_rest_is_planned_around_them():
    user = {"finetune.method": "lora", "finetune.r": 4, "optim.lr": 1e-3, "train.micro_batch_size": 8,
            "train.seq_len": 128}
    p = S.plan_sft(120, table(), DEMO, TASKS, user)
    s, why = p.settings, {c.key: c.why for c in p.choices}
    for k, v in user.items():
        assert s[k] == v and why[k] == "user"
    assert s["finetune.alpha"] == 8.0  # 2 x the user's rank
    # a rank alone means adapters: full fine-tuning (which the rule prefers here) would ignore it
    q = S.plan_sft(120, table(), DEMO, TASKS, {"finetune.r": 8})
    assert q.settings["finetune.method"] == "lora" and q.settings["finetune.r"] == 8
    assert {c.key: c.why for c in q.choices}["finetune.method"] == "you set finetune.r"
    # planned around the user's micro-batch and context: steps from their step's tokens
    assert p.predicted["steps"] == int(4000.0 * s["train.max_time"] / (8 * 128))
    # without exact-match records there is no exact-match phase: training gets its share
    plain = S.DataFacts(examples=4000, tokens=160_000, length_q=57, max_length=70, prepare_s=1.0)
    assert S.plan_sft(120, table(), DEMO, plain, {}).phases["exact match"] == 0


def test_a_budget_too_small_names_the_smallest_that_works():
    with pytest.raises(ConfigError, match="the smallest budget that would work is") as e:
        S.plan_sft(10, table(), DEMO, TASKS, {})
    smallest = int(str(e.value).rsplit(" ", 1)[1].rstrip("s"))
    S.plan_sft(smallest, table(), DEMO, TASKS, {})  # works
    with pytest.raises(ConfigError):
        S.plan_sft(smallest - 1, table(), DEMO, TASKS, {})


@pytest.mark.parametrize("budget, user, message", [
    (60, {"train.max_time": 30}, "remove train.max_time"),
    (0, {}, "above 0"),
    (25 * 3600, {}, "at most 24h"),
])
def test_refusals(budget, user, message):
    with pytest.raises(ConfigError, match=message):
        S.plan_sft(budget, table(), DEMO, TASKS, user)


def test_rules_agree_with_the_bench():
    """The constants are the bench's results (bench/results/sft_planner_rules.json)."""
    rules = json.loads((REPO / "bench" / "results" / "sft_planner_rules.json").read_text())["rules"]
    assert S.LORA_R == rules["lora_r"] and S.LORA_LR == pytest.approx(rules["lora_lr"])
    assert S.FULL_LR == pytest.approx(rules["full_lr"])
    assert S.FULL_BEATS_LORA == rules["full_beats_lora"]
