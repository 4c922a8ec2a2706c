"""The budget planner's pure choice (tools/planner.py) on fake throughput tables."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from lmforge.errors import ConfigError
from lmforge.models.flops import flops_per_token
from lmforge.tools import planner as P

REPO = Path(__file__).resolve().parents[2]
# tokens/s the speedrun measured on 2 cores (bench/results/speedrun_search.json), and two guesses below
CPU = {(96, 3): 15000, (128, 4): 11300, (192, 4): 8700, (256, 4): 6700, (256, 6): 4600, (320, 5): 4600}


def table(speeds=CPU, spent=1.0, device="cpu", seq=256) -> P.Throughput:
    pts = []
    for s in P.LADDER:
        if (s.d_model, s.n_layers) in speeds:
            mc = P.model_config(s, 4096, seq)
            tps = speeds[(s.d_model, s.n_layers)]
            pts.append(P.Measured(s, 16, seq, 4096, flops_per_token(mc, seq), tps))
    return P.Throughput(device, tuple(pts), spent_s=spent)


def test_plan_chooses_from_the_table_and_says_why():
    p = P.plan(300, table(), P.Corpus(), {})
    s = p.settings
    shape = tuple(s[f"model.{k}"] for k in ("d_model", "n_layers", "n_heads", "n_kv_heads"))
    assert shape == (96, 3, 3, 3)  # the fastest shape the table has: smaller models that see more tokens
    assert s["optim.lr"] == pytest.approx(P.LR_AT_128 * 128 / 96) and s["train.micro_batch_size"] == 16
    assert s["schedule.name"] == "wsd" and s["schedule.unit"] == "time"
    assert s["data.tokenizer.vocab_size"] == 4096 and s["train.precision"] == "fp32"
    # the phases add up to the budget, and training gets most of it
    assert sum(p.phases.values()) == pytest.approx(300, abs=0.1)
    assert 0.8 * 300 < s["train.max_time"] < 300
    why = {c.key: c.why for c in p.choices}
    assert "measured: 15,000 tok/s" in why["model.d_model"]
    text = p.table()
    assert "model.d_model" in text and "rule: lowest L(N,D)" in text
    assert "| d96-L3 |" in p.markdown()
    json.dumps(p.to_json())  # plain data


def test_plan_is_deterministic():
    assert P.plan(120, table(), P.Corpus(), {}).to_json() == P.plan(120, table(), P.Corpus(), {}).to_json()


def test_more_budget_never_chooses_a_smaller_model():
    sizes = []
    for budget in (20, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200):
        s = P.plan(budget, table(), P.Corpus(), {}).settings
        sizes.append(s["model.d_model"] ** 2 * s["model.n_layers"])
    assert sizes == sorted(sizes)
    assert sizes[0] < sizes[-1]  # and a long enough budget does choose a larger one


def test_a_faster_machine_chooses_a_larger_model():
    fast = {k: 20 * v for k, v in CPU.items()}
    slow, quick = P.plan(300, table(), P.Corpus(), {}), P.plan(300, table(fast), P.Corpus(), {})
    assert quick.predicted["params"] > slow.predicted["params"]


def test_user_keys_win_and_the_rest_is_planned_around_them():
    p = P.plan(300, table(), P.Corpus(), {"model.d_model": 256, "optim.lr": 1e-3})
    s, why = p.settings, {c.key: c.why for c in p.choices}
    assert s["model.d_model"] == 256 and why["model.d_model"] == "user"
    assert s["optim.lr"] == 1e-3 and why["optim.lr"] == "user"
    assert s["model.n_heads"] * 32 == 256  # heads follow the width
    # without the user's lr, the width rule gives lr for their width
    lr = P.plan(300, table(), P.Corpus(), {"model.d_model": 256}).settings["optim.lr"]
    assert lr == pytest.approx(P.LR_AT_128 / 2)
    # ... never above the largest lr the grid measured winning (d64: 2.83e-3 x 2 would be 5.7e-3)
    narrow = P.plan(300, table(), P.Corpus(), {"model.d_model": 64}).settings
    assert narrow["optim.lr"] == P.LR_RANGE[1] == 4e-3
    assert P.plan(300, table(), P.Corpus(), {"data.tokenizer.vocab_size": 2048}).settings[
        "data.tokenizer.vocab_size"] == 2048


def test_a_budget_too_small_names_the_smallest_that_works():
    with pytest.raises(ConfigError, match=r"smallest budget that would work is (\d+)s") as e:
        P.plan(8, table(), P.Corpus(), {})
    least = float(e.value.args[0].rsplit(" ", 1)[1].rstrip("s"))
    P.plan(least, table(), P.Corpus(), {})  # the budget it names does work
    with pytest.raises(ConfigError, match="too small"):
        P.plan(least - 1, table(), P.Corpus(), {})


def test_budget_bounds_and_refused_keys():
    with pytest.raises(ConfigError, match="at most 24h"):
        P.plan(25 * 3600, table(), P.Corpus(), {})
    with pytest.raises(ConfigError, match="remove train.max_time"):
        P.plan(300, table(), P.Corpus(), {"train.max_time": 60})
    with pytest.raises(ConfigError, match="no shape"):
        P.plan(300, P.Throughput("cpu", ()), P.Corpus(), {})


def test_unmeasured_shapes_are_not_chosen_and_speeds_interpolate():
    t = table({(128, 4): 10000, (256, 4): 5000})
    f128, f256 = (p.flops_per_token for p in t.points)
    assert t.tokens_per_s(f128) == 10000 and t.tokens_per_s(f256) == pytest.approx(5000)
    mid = math.sqrt(f128 * f256)
    assert t.tokens_per_s(mid) == pytest.approx(math.sqrt(10000 * 5000))  # log-log
    assert t.tokens_per_s(f128 / 2) == 10000 and t.tokens_per_s(f256 * 1.5) is None
    # a noisy table never makes a bigger model faster
    noisy = table({(128, 4): 10000, (256, 4): 12000})
    assert noisy.tokens_per_s(noisy.points[1].flops_per_token) == 10000
    rows = {r["shape"]: r for r in P.plan(3600, t, P.Corpus(), {}).candidates}
    assert rows["d512-L8"]["why"] == "larger than the largest shape measured"


def test_the_corpus_and_the_budget_bound_what_is_read():
    p = P.plan(300, table(), P.Corpus(chars=2_000_000), {})
    assert p.settings["data.max_chars"] == 2_000_000
    big = P.plan(300, table(), P.Corpus(), {}).settings["data.max_chars"]
    assert big <= P.PREPARE_SHARE * 300 * P.PREPARE_CHARS_PER_S
    # what is read comes from the whole corpus, not its first documents; a user's choice is kept
    assert p.settings["data.max_chars_from"] == "spread"
    kept = P.plan(300, table(), P.Corpus(), {"data.max_chars_from": "start"})
    assert kept.settings["data.max_chars_from"] == "start"
    # enough held-out text for the evaluation's batches
    s = P.plan(300, table(), P.Corpus(), {}).settings
    val_tokens = s["data.val_fraction"] * big / P.CHARS_PER_TOKEN[4096]
    assert val_tokens >= s["train.eval_batches"] * 16 * 257


def test_the_rules_are_the_measured_ones():
    rules = json.loads((REPO / "bench" / "results" / "planner_rules.json").read_text())
    law = rules["law"]
    for k in ("E", "A", "B", "alpha", "beta"):
        assert P.LAW[k] == pytest.approx(law[k], rel=1e-4, abs=1e-6), k
    assert P.LAW_MIN_PARAMS == 0.5 * rules["range"]["min_params"]
    assert P.REPEAT_HALF_LIFE == law["repeat_half_life"]
    assert P.LR_AT_128 == pytest.approx(rules["lr"]["lr_at_128"], rel=1e-5)
    assert P.LR_RANGE[1] == rules["lr"]["max_lr"]
    batch = rules["batch"]
    assert P.BATCH_RULE == (pytest.approx(batch["coefficient"], rel=1e-3), batch["exponent"])
    assert P.PREPARE_CHARS_PER_S == pytest.approx(rules["prepare"]["chars_per_s"], rel=1e-6)
    assert P.CHARS_PER_TOKEN == {int(k): v for k, v in rules["prepare"]["chars_per_token"].items()}


def test_the_law_chooses_the_shape_the_grids_measured_best_on_its_own_corpus(monkeypatch):
    """bench/planner_rules.py's ranks: each planner_quality cell's shapes by measured bpb and by the law at
    their own tokens; stored as measured, and on python the law's first is the measured first at 2 and 5
    minutes (the law's data) and at 15 (a budget it was not fitted to: bench/planner_law_scan.py)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import planner_rules

    rules = json.loads((REPO / "bench" / "results" / "planner_rules.json").read_text())
    assert planner_rules.ranks(rules["law"]) == rules["ranks"]
    fitted = {(r["corpus"], r["budget_s"]): r for r in rules["ranks"]}
    for budget in (*planner_rules.LAW_BUDGETS_S, 900.0):
        cell = fitted["python", budget]
        assert cell["first_right"] and cell["measured"][0] == cell["predicted"][0], budget


def test_repeated_epochs_are_worth_less_and_a_small_corpus_is_not_memorized():
    assert P.effective_tokens(5e5, 1e6) == 5e5 and P.effective_tokens(5e5, None) == 5e5
    # Muennighoff et al. 2023 eq. 5 with their R*_D = 15.4: 4 epochs of U tokens are worth 3.73 U
    assert P.effective_tokens(4e6, 1e6, 15.4) == pytest.approx(1e6 * (1 + 15.4 * (1 - math.exp(-3 / 15.4))))
    assert P.effective_tokens(4e6, 1e6, 15.4) == pytest.approx(3.7258e6, rel=1e-4)
    h = P.REPEAT_HALF_LIFE  # the planner's, fitted to the python grid
    assert P.effective_tokens(4e6, 1e6) == pytest.approx(1e6 * (1 + h * (1 - math.exp(-3 / h))))
    assert P.effective_tokens(1e9, 1e6) < 1e6 * (1 + h) + 1  # never more than U (1 + R*)
    small, large = P.plan(1800, table(), P.Corpus(chars=1_000_000), {}), P.plan(1800, table(), P.Corpus(), {})
    vocab = small.settings["data.tokenizer.vocab_size"]  # 2048: 1M characters fill 4096 entries too thinly
    unique = 1_000_000 * (1 - P.HELD_SHARE) / P.CHARS_PER_TOKEN[vocab]
    assert small.predicted["tokens"] <= P.EPOCH_CAP * unique + 1 < large.predicted["tokens"]
    rows = {r["shape"]: r for r in small.candidates}
    for r in rows.values():
        bound = min(P.EPOCH_CAP, P.DATA_BOUND * unique / r["params"])
        assert r["loss"] is None or r["epochs"] <= bound + 0.01
    assert rows["d96-L3"]["epochs"] == P.EPOCH_CAP and "| epochs | seconds |" in small.markdown()
    assert "not needed" in small.phases and "not needed" not in large.phases


# the H200's probe of 2026-11-29 (bench/results/gpu_suite: the planner row), 16 x 1024 tokens, bf16
H200 = {(64, 2): 1634997, (96, 3): 1506577, (128, 4): 998501, (192, 4): 1186763, (256, 4): 996847,
        (256, 6): 803876, (320, 5): 792487, (384, 6): 925045, (512, 8): 599424, (640, 10): 435178}


def test_a_corpus_too_small_for_the_machine_bounds_the_epochs_and_the_run_ends_early():
    """At most EPOCH_CAP epochs and DATA_BOUND / (N/U): on the H200, builtin:python's 8.4M characters (1.9M
    unique tokens) chose d640-L10 for 58 epochs, which memorized them (2.66 bpb); bounded, a smaller model
    trains 10 epochs and the run ends minutes before its budget, saying why."""
    assert P.bounded_tokens(1e6, 5e6, None) == 5e6  # no corpus size: no bound
    assert P.bounded_tokens(1e5, 5e6, 1e6) == 5e6  # 5 epochs, 0.1 parameters per unique token
    assert P.bounded_tokens(1e5, 5e7, 1e6) == P.EPOCH_CAP * 1e6
    assert P.bounded_tokens(4e7, 5e7, 1e6) == pytest.approx(P.DATA_BOUND / 40 * 1e6)
    gpu = table(H200, spent=20.1, device="cuda", seq=1024)
    p = P.plan(300, gpu, P.Corpus(chars=8_378_640), {})
    unique = 8_378_640 * (1 - P.HELD_SHARE) / P.CHARS_PER_TOKEN[4096]
    n, d = p.predicted["params"], p.predicted["tokens"]
    assert d <= P.EPOCH_CAP * unique + 1 and n * d <= P.DATA_BOUND * unique ** 2 * 1.0001
    assert n < 45_479_040 and p.settings["model.d_model"] < 640  # not d640-L10
    assert p.phases["not needed"] > 100 and sum(p.phases.values()) == pytest.approx(300, abs=0.1)
    assert p.settings["train.max_time"] == pytest.approx(d / p.predicted["tokens_per_s"], abs=0.01)
    assert "more would memorize them" in {c.key: c.why for c in p.choices}["train.max_time"]
    rows = {r["shape"]: r for r in p.candidates}
    assert rows["d640-L10"]["epochs"] == pytest.approx(P.DATA_BOUND / (45_479_040 / unique), rel=1e-3)
    # a corpus as large as the budget reads trains the whole budget
    whole = P.plan(300, gpu, P.Corpus(), {})
    assert "not needed" not in whole.phases
    # the CPU planner's choice where the corpus is large enough is unchanged: python's 15 minutes
    assert P.plan(900, table(), P.Corpus(chars=9_150_973, val_chars=407_809), {}).settings[
        "model.d_model"] == P.plan(900, table(), P.Corpus(), {}).settings["model.d_model"]


def test_the_vocabulary_fits_the_corpus_as_well_as_the_budget():
    assert P.vocab_for(300, {})[0] == 4096
    assert P.vocab_for(300, {}, 8_000_000)[0] == 4096
    assert P.vocab_for(300, {}, 400_000) == (1024, "rule: >= 250 sample chars per entry (400,000 chars)")
    assert P.vocab_for(300, {}, 700_000)[0] == 2048
    assert P.vocab_for(300, {"data.tokenizer.vocab_size": 8192}, 1000)[0] == 8192
    assert P.plan(300, table(), P.Corpus(chars=400_000), {}).settings["data.tokenizer.vocab_size"] == 1024


def test_the_warm_up_is_100_updates_or_5_percent_of_training_the_longer():
    fast = P.plan(120, table({(64, 2): 28000, (96, 3): 17000}), P.Corpus(), {}).settings
    step = fast["train.grad_accum_steps"] * 16 * 256 / 28000  # d64-L2: ~0.15 s an update
    assert fast["model.d_model"] == 64
    assert fast["schedule.warmup_seconds"] == pytest.approx(100 * step, abs=0.01)
    assert 100 * step > 0.05 * fast["train.max_time"]  # the old rule's 5% would have been ~35 updates
    long = P.plan(3600, table({(64, 2): 28000, (96, 3): 17000}), P.Corpus(), {}).settings
    assert long["schedule.warmup_seconds"] == pytest.approx(0.05 * long["train.max_time"], abs=0.01)
    slow = P.plan(60, table({(64, 2): 2000}), P.Corpus(), {}).settings  # 100 updates: more than the cap
    assert slow["schedule.warmup_seconds"] == pytest.approx(0.25 * slow["train.max_time"], abs=0.01)
    mine = P.plan(120, table(), P.Corpus(), {"schedule.warmup_seconds": 3.0}).settings
    assert mine["schedule.warmup_seconds"] == 3.0


def test_the_evaluation_keeps_what_its_batches_take_at_the_measured_forward_speed():
    """The final evaluation is 3% of the budget at the forward speed the probe measured (2 cores: 2.0-2.8x
    a step's), at most the held-out text's windows; the time kept after training is what those batches take
    (x1.25, + the final checkpoint), so a small held-out text leaves the rest to training."""
    step = 16 * 256 / 15000
    timed = P.Throughput("cpu", tuple(replace(p, eval_batch_s=step / 2.5)
                                      for p in table({(96, 3): 15000}).points), spent_s=1.0)
    p, old = P.plan(300, timed, P.Corpus(), {}), P.plan(300, table({(96, 3): 15000}), P.Corpus(), {})
    n = p.settings["train.eval_batches"]
    assert n == int(0.03 * 300 / (step / 2.5))
    assert old.settings["train.eval_batches"] == int(0.03 * 300 / (step / 2))  # no forward timed: 2x
    assert p.phases["evaluate"] == pytest.approx(n * step / 2.5 * P.EVAL_SAFETY + P.EVAL_FIXED_S, abs=0.01)
    assert sum(p.phases.values()) == pytest.approx(300, abs=0.1)
    # data.val_sources are evaluated whole: no more batches than their windows (+25%), no more time kept
    held = P.plan(300, timed, P.Corpus(val_chars=400_000), {})
    windows = 400_000 / P.CHARS_PER_TOKEN[4096] / 256
    assert held.settings["train.eval_batches"] == math.ceil(1.25 * windows / 16) < n
    assert held.phases["evaluate"] == pytest.approx(
        held.settings["train.eval_batches"] * step / 2.5 * P.EVAL_SAFETY + P.EVAL_FIXED_S, abs=0.01)
    assert held.settings["train.max_time"] > p.settings["train.max_time"] + 5
    assert "at most the held-out text's windows" in {c.key: c.why for c in held.choices}["train.eval_batches"]


def test_the_probe_stops_before_shapes_that_cannot_win(monkeypatch):
    """On a CPU a shape is measured only where the loss rule, at 1.5x the best FLOP/s measured so far,
    says it could beat the shapes measured: at 2 minutes d64-L2 and d96-L3 are enough (the rest took ~3 s
    of the probe), a long budget measures on, and a GPU (whose FLOP/s grows with the shape) always does."""
    import time

    from lmforge.tools import planner_probe as PP

    speeds = {(64, 2): 29865, (96, 3): 16350, (128, 4): 9637, (192, 4): 5974, (256, 4): 4122}
    corpus = P.Corpus(chars=9_000_000, val_chars=450_000)
    two = table(dict(list(speeds.items())[:2]))
    assert not P.could_win(120, two, corpus, {}, list(P.LADDER[2:]))
    assert P.could_win(3600, two, corpus, {}, list(P.LADDER[2:]))
    assert P.could_win(120, replace(two, device="cuda"), corpus, {}, list(P.LADDER[2:]))
    # the shapes it skips are ones the whole table would not have chosen
    assert P.plan(120, two, corpus, {}).settings["model.d_model"] == \
        P.plan(120, table(speeds), corpus, {}).settings["model.d_model"]

    timed = []

    def fake_step(shape, vocab, micro, seq, device, precision, until, keep=True, shape_s=1.0):
        timed.append(shape.name)
        step = micro * seq / speeds.get((shape.d_model, shape.n_layers), 30000)
        return step, step / 8, None

    monkeypatch.setattr(PP, "_step_seconds", fake_step)
    said = []
    got = PP.probe(120, {"train.precision": "fp32"}, PP.Deadline.since(120, time.perf_counter()), "cpu",
                   said.append, corpus)
    assert [p.shape.name for p in got.points] == ["d64-L2", "d96-L3"]
    assert timed[1:] == ["d64-L2", "d96-L3"] * 2  # both within 10% of the best loss: timed again
    assert got.points[0].eval_batch_s == pytest.approx(16 * 256 / 29865 / 8)
    assert any("d128-L4 and larger: not measured" in s for s in said)
    everything = PP.probe(120, {"train.precision": "fp32"}, PP.Deadline.since(120, time.perf_counter()),
                          "cpu", said.append)  # no corpus: no rule to stop by
    assert len(everything.points) > 2


def test_a_stalled_reading_is_timed_again_and_the_faster_kept(monkeypatch):
    """A stall of the machine while d64-L2 is timed (its first reading at 60% of its speed, as two busy
    2-minute runs read it) plans d96-L3; the second pass times the shapes within 10% of the best predicted
    loss once more and keeps the faster reading, so the plan is the one the shapes' own speeds make."""
    import time

    from lmforge.tools import planner_probe as PP

    speeds = {(64, 2): 29865, (96, 3): 16350, (128, 4): 9637, (192, 4): 5974, (256, 4): 4122}
    corpus = P.Corpus(chars=9_000_000, val_chars=450_000)
    stalled = {**speeds, (64, 2): 0.6 * 29865}
    assert P.plan(120, table(speeds), corpus, {}).settings["model.d_model"] == 64
    assert P.plan(120, table(stalled), corpus, {}).settings["model.d_model"] == 96  # what a stall did
    reads: list[str] = []

    def fake_step(shape, vocab, micro, seq, device, precision, until, keep=True, shape_s=1.0):
        reads.append(shape.name)
        key = (shape.d_model, shape.n_layers)
        tps = (stalled if reads.count(shape.name) == 1 else speeds).get(key, 30000)
        return micro * seq / tps, micro * seq / tps / 8, None

    monkeypatch.setattr(PP, "_step_seconds", fake_step)
    said: list[str] = []
    got = PP.probe(120, {"train.precision": "fp32"}, PP.Deadline.since(120, time.perf_counter()), "cpu",
                   said.append, corpus)
    # the stalled d64-L2 let d128-L4 be measured too; all three are within 10%, all three timed again
    assert reads[1:] == ["d64-L2", "d96-L3", "d128-L4"] * 2
    assert [round(q.tokens_per_s) for q in got.points] == [29865, 16350, 9637]
    assert P.plan(120, got, corpus, {}).settings["model.d_model"] == 64
    assert "  again (the shapes within 10% of the best predicted loss): d64-L2, d96-L3, d128-L4" in said
    # without a corpus (no loss rule to rank by) or with one shape measured there is no second pass
    reads.clear()
    PP.probe(120, {"train.precision": "fp32"}, PP.Deadline.since(120, time.perf_counter()), "cpu",
             said.append)
    assert len(reads) == len(set(reads)) > 3
