"""Scaling laws: the fit recovers known laws, the closed-form optimum is the true optimum, the published
Chinchilla numbers come out, the shape chooser hits N, the planned config is valid; sweep grid parsing."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import yaml

from lmforge.config import load_config
from lmforge.config.schema import Config, ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.flops import count_params
from lmforge.tools import scaling
from lmforge.tools.scaling import (
    LAWS,
    Law,
    choose_shape,
    fit_law,
    load_law,
    make_plan,
    plan_config,
    run_points,
)
from lmforge.tools.sweep import grid_points, parse_axis, point_name

PARAMS = ("E", "A", "B", "alpha", "beta")


def synthetic(law: Law, noise: float, seed: int = 0) -> tuple[list[float], list[float], list[float]]:
    """Losses of `law` on a 5 x 5 grid of N (1e7..1e9) and D (1e9..1e11), times exp(noise * N(0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    ns, ds, ls = [], [], []
    for n in (1e7, 3e7, 1e8, 3e8, 1e9):
        for d in (1e9, 3e9, 1e10, 3e10, 1e11):
            ns.append(n)
            ds.append(d)
            ls.append(law.loss(n, d) * math.exp(noise * torch.randn(1, generator=gen).item()))
    return ns, ds, ls


@pytest.mark.parametrize("name", ["hoffmann", "epoch"])
def test_fit_recovers_a_law_exactly_without_noise(name):
    true = LAWS[name]
    fit = fit_law(*synthetic(true, 0.0))
    for k in PARAMS:
        assert getattr(fit, k) == pytest.approx(getattr(true, k), rel=1e-4), k


def test_fit_recovers_a_law_within_tolerance_with_noise():
    true = Law(E=1.9, A=300.0, B=1200.0, alpha=0.32, beta=0.30)
    fit = fit_law(*synthetic(true, 0.002))  # 0.2% loss noise
    # E and the exponents are identified well; A and B trade off against the exponents (~20% here)
    assert fit.E == pytest.approx(true.E, rel=0.02)
    assert fit.alpha == pytest.approx(true.alpha, abs=0.02)
    assert fit.beta == pytest.approx(true.beta, abs=0.02)
    assert fit.A == pytest.approx(true.A, rel=0.35) and fit.B == pytest.approx(true.B, rel=0.35)
    # a 10x extrapolation in both N and D
    assert fit.loss(1e10, 1e12) == pytest.approx(true.loss(1e10, 1e12), rel=0.005)
    # the tolerances discriminate: a different law is outside them
    other = LAWS["epoch"]
    assert abs(other.alpha - fit.alpha) > 0.02 or abs(other.E / fit.E - 1) > 0.02


def test_fit_needs_five_points():
    with pytest.raises(LmforgeError, match="at least 5"):
        fit_law([1e6] * 4, [1e9] * 4, [3.0] * 4)


@pytest.mark.parametrize("name", ["hoffmann", "epoch"])
@pytest.mark.parametrize("compute", [1e15, 1e19, 5.76e23, 1e26])
def test_closed_form_optimum_is_the_minimum_along_the_iso_flop_line(name, compute):
    law = LAWS[name]
    log_n = torch.linspace(math.log(1e3), math.log(1e15), 200_001, dtype=torch.float64)
    n = log_n.exp()
    loss = law.E + law.A / n**law.alpha + law.B / (compute / 6 / n) ** law.beta
    n_num = float(n[loss.argmin()])  # grid step 1.7e-4 in log N
    n_opt, d_opt = law.optimum(compute)
    assert n_opt == pytest.approx(n_num, rel=5e-4)
    assert 6 * n_opt * d_opt == pytest.approx(compute, rel=1e-12)
    # the inverses agree with the optimum
    assert law.compute_for_params(n_opt) == pytest.approx(compute, rel=1e-9)
    assert law.compute_for_tokens(d_opt) == pytest.approx(compute, rel=1e-9)


def test_hoffmann_reproduces_the_published_approach_3_numbers():
    law = LAWS["hoffmann"]
    # Hoffmann et al. fig. 1 / sec. 3.4: approach 3 puts Gopher's budget (5.76e23 FLOPs) at 40B parameters
    n, d = law.optimum(5.76e23)
    assert round(n / 1e9) == 40
    # table 2: approach 3's exponents N_opt ~ C^0.46, D_opt ~ C^0.54
    assert round(law.a, 2) == 0.46 and round(1 - law.a, 2) == 0.54
    # the body text's rounded values (alpha 0.34, beta 0.28) do not reproduce it (Besiroglu et al. sec. 4)
    rounded = Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
    assert round(rounded.optimum(5.76e23)[0] / 1e9) == 32


def test_epoch_law_matches_the_published_replication():
    law = LAWS["epoch"]
    # Besiroglu et al.: the refit's N_opt ~ C^0.51 is compatible with approaches 1 and 2 (a ~ 0.5), and
    # at Chinchilla's budget it gives ~70B on ~1.4T tokens (about 20 tokens per parameter)
    assert round(law.a, 2) == 0.51
    n, d = law.optimum(5.76e23)
    assert 65e9 < n < 75e9
    assert 15 < d / n < 25


def test_shape_chooser_hits_n_within_tolerance():
    base = load_config(None, ["model.vocab_size=32000", "model.n_heads=8", "model.n_kv_heads=2"]).model
    for target in torch.logspace(7, 11, 9).tolist():
        sec, n = choose_shape(target, base)
        assert abs(n / target - 1) <= scaling.SIZE_TOLERANCE, (target, n)
        model = ModelConfig.model_validate(sec)
        assert count_params(model) == n
        assert model.d_model % 64 == 0 and model.resolved_head_dim in (64, 128)
        assert 16 <= model.d_model / model.n_layers <= 256, sec
        assert model.vocab_size == 32000 and model.max_seq_len == base.max_seq_len
    # a base with GQA keeps its ratio where a shape within tolerance allows it
    sec, _ = choose_shape(3e8, base)
    assert sec["n_heads"] == 4 * sec["n_kv_heads"]
    # non-embedding counting (Kaplan's) leaves every vocabulary table out, the tied output projection too
    sec, n = choose_shape(1e8, base, count="non-embedding")
    model = ModelConfig.model_validate(sec)
    assert n == count_params(model) - 32000 * model.d_model
    assert n == pytest.approx(12 * model.n_layers * model.d_model**2, rel=0.15)  # ~12 L d^2 (GQA: less)


def test_plan_batch_lr_and_steps_follow_the_documented_rules():
    base = Config.model_validate({"model": {"vocab_size": 32000, "max_seq_len": 2048},
                                  "train": {"micro_batch_size": 8}})
    plan = make_plan(LAWS["epoch"], compute=1e20, base=base)
    # DeepSeek LLM eq. 1 at C = 1e20: B = 0.292 C^0.3271 ~ 1.02M tokens, lr = 0.3118 C^-0.125 ~ 9.9e-4
    assert plan.lr == pytest.approx(0.3118 * 1e20**-0.125, rel=1e-12)
    assert plan.batch_tokens == pytest.approx(0.292 * 1e20**0.3271, rel=0.01)  # rounded to 8-sequence steps
    assert plan.batch_tokens == plan.micro * plan.accum * 2048 and plan.micro == 8
    assert plan.tokens >= plan.d_target > plan.tokens - plan.batch_tokens
    assert abs(plan.n_actual / plan.n_target - 1) <= scaling.SIZE_TOLERANCE
    # clamps at the extremes
    assert make_plan(LAWS["epoch"], compute=1e12, base=base).lr == scaling.LR_RANGE[1]
    assert make_plan(LAWS["epoch"], compute=1e30, base=base).batch_tokens <= scaling.MAX_BATCH_TOKENS
    # --params / --tokens give the budget for which they are optimal
    assert make_plan(LAWS["epoch"], params=plan.n_target, base=base).compute == pytest.approx(1e20, rel=1e-9)
    assert make_plan(LAWS["epoch"], tokens=plan.d_target, base=base).compute == pytest.approx(1e20, rel=1e-9)
    with pytest.raises(LmforgeError, match="exactly one"):
        make_plan(LAWS["epoch"], compute=1e20, params=1e9)


def test_planned_config_is_valid_and_realises_the_plan(tmp_path):
    base = load_config(None, ["model.vocab_size=4096", "train.micro_batch_size=16", "model.max_seq_len=256",
                              "schedule.warmup_steps=1000"])
    plan = make_plan(LAWS["hoffmann"], compute=1e15, base=base)
    data = plan_config(plan, base.model_dump(mode="json"))
    cfg = Config.model_validate(yaml.safe_load(yaml.safe_dump(data)))
    assert count_params(cfg.model) == plan.n_actual
    assert cfg.train.max_steps == plan.steps and cfg.optim.lr == plan.lr
    assert cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.seq_len == plan.batch_tokens
    assert cfg.schedule.warmup_steps <= plan.steps // 5
    assert cfg.run.dir == "runs/run-plan"  # never the base's run dir


def test_load_law_reads_a_fit_file_and_refuses_bad_ones(tmp_path):
    good = tmp_path / "fit.json"
    good.write_text(json.dumps({"law": {"E": 2.0, "A": 100.0, "B": 200.0, "alpha": 0.3, "beta": 0.3,
                                        "count": "non-embedding"}}))
    law = load_law(str(good))
    assert (law.E, law.alpha, law.count) == (2.0, 0.3, "non-embedding")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"law": {"E": 2.0, "A": -1, "B": 200.0, "alpha": 0.3, "beta": 0.3}}))
    with pytest.raises(LmforgeError, match="law.A must be a positive number"):
        load_law(str(bad))
    with pytest.raises(LmforgeError, match="not a known law"):
        load_law(str(tmp_path / "missing.json"))


def test_run_points_reads_n_d_and_final_loss(tmp_path):
    cfg = load_config(None, ["model.vocab_size=512", "model.d_model=64", "model.n_layers=2"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    records = [{"step": 10, "loss": 5.0, "tokens_seen": 1000}, {"step": 15, "val_loss": 4.9},
               {"step": 20, "loss": 4.5, "tokens_seen": 2000}, {"step": 20, "val_loss": 4.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (p,) = run_points(tmp_path)
    assert (p.n, p.d, p.loss, p.final) == (count_params(cfg.model), 2000, 4.4, True)
    first, last = run_points(tmp_path, count="non-embedding", all_evals=True)
    assert first.d == 1500 and first.loss == 4.9 and not first.final  # interpolated between logged steps
    assert last.n == count_params(cfg.model) - 512 * 64
    # damaged records (strings, NaN, not objects) are ignored, not trusted
    with open(tmp_path / "metrics.jsonl", "a") as f:
        for bad in ({"step": "20", "val_loss": 1.0}, {"step": 20, "val_loss": "NaN"}, [1, 2], "x",
                    {"step": 20, "val_loss": float("nan")}):
            f.write(json.dumps(bad) + "\n")
    assert run_points(tmp_path)[0].loss == 4.4
    # an unfinished run (validation before its last step) is refused
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 30, "loss": 4.0, "tokens_seen": 3000}) + "\n")
    with pytest.raises(LmforgeError, match="did not finish"):
        run_points(tmp_path)


def test_sweep_grid_random_search_and_names():
    axes = [parse_axis("model.d_model=64,128"), parse_axis("train.max_steps=100,200")]
    assert grid_points(axes) == [{"model.d_model": 64, "train.max_steps": 100},
                                 {"model.d_model": 64, "train.max_steps": 200},
                                 {"model.d_model": 128, "train.max_steps": 100},
                                 {"model.d_model": 128, "train.max_steps": 200}]
    lr = parse_axis("optim.lr=1e-4..1e-2")
    assert lr.log and (lr.low, lr.high) == (1e-4, 1e-2)
    draws = [lr.sample(random.Random(i)) for i in range(2000)]
    assert all(1e-4 <= x <= 1e-2 for x in draws)
    below_1e3 = sum(x < 1e-3 for x in draws) / len(draws)
    assert below_1e3 == pytest.approx(0.5, abs=0.05)  # log-uniform: half the mass in each decade
    pts = grid_points([lr, parse_axis("model.n_layers=1..4")], random_k=5, seed=3)
    assert pts == grid_points([lr, parse_axis("model.n_layers=1..4")], random_k=5, seed=3)
    assert all(isinstance(p["model.n_layers"], int) and 1 <= p["model.n_layers"] <= 4 for p in pts)
    with pytest.raises(LmforgeError, match="needs --random"):
        grid_points([lr])
    with pytest.raises(LmforgeError, match="expected KEY"):
        parse_axis("model.d_model")
    assert point_name({"model.d_model": 64, "optim.lr": 0.001}) == "d_model=64_lr=0.001"
    for hostile in ("../../etc", "/abs/path", "a/b\\c", "..", "x" * 300):
        name = point_name({"run.note": hostile})
        assert "/" not in name and "\\" not in name and name not in ("", ".", "..") and len(name) <= 80


def _fake_run(path, d_model: int, tokens: int, law: Law, finished: bool = True) -> None:
    """A run dir as `lmforge train` leaves it: its resolved config.yaml and metrics.jsonl (the final
    validation loss on `law`), or, not `finished`, a run cut short after its first validation."""
    cfg = load_config(None, ["model.vocab_size=512", f"model.d_model={d_model}", "model.n_layers=2"])
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    loss = law.loss(count_params(cfg.model), tokens)
    records = [{"step": 10, "tokens_seen": tokens // 2}, {"step": 10, "val_loss": loss + 0.5},
               {"step": 20, "tokens_seen": tokens}] + ([{"step": 20, "val_loss": loss}] if finished else [])
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_scaling_fit_takes_a_sweep_dir_or_its_glob_and_names_what_it_skipped(tmp_path):
    """The README's `lmforge scaling fit sweeps/s1/*`: the sweep dir also holds each point's log and
    sweep.json, which are skipped and named; a point that did not finish is skipped (with its reason)
    when found inside a sweep dir, and an error when named on its own."""
    from lmforge.tools.scaling import fit_points, run_fit

    law, sweep = LAWS["epoch"], tmp_path / "s1"
    for i, (d, tokens) in enumerate([(32, 40_000), (32, 90_000), (64, 40_000), (64, 90_000), (96, 60_000)]):
        _fake_run(sweep / f"p{i}", d, tokens, law)
        (sweep / f"p{i}.log").write_text("training log\n")
    (sweep / "sweep.json").write_text("{}")
    said: list[str] = []
    record = run_fit([str(sweep)], samples=0, say=said.append)  # the one fit; the rest reads points only
    assert len(record["points"]) == 5 and "5 points from 5 runs" in "\n".join(said)
    assert f"skipped {sweep / 'sweep.json'}: not a run dir" in "\n".join(said)
    skipped = {Path(s["path"]).name for s in record["skipped"]}
    assert skipped == {f"p{i}.log" for i in range(5)} | {"sweep.json"}
    for args in ([str(p) for p in sorted(sweep.iterdir())], [str(sweep / "*")]):  # the shell's glob, ours
        points, used, inputs = fit_points(args)
        assert (len(points), used, len(inputs.skipped)) == (5, 5, 6), args
    # a point that did not finish: skipped, with its reason, when found inside the sweep dir...
    _fake_run(sweep / "p5", 96, 90_000, law, finished=False)
    points, used, inputs = fit_points([str(sweep)])
    assert (len(points), used) == (5, 5)
    assert [why for path, why in inputs.skipped if path.endswith("p5")] == [
        "the last validation (step 10) is before the last step (20); the run did not finish"]
    # ... and an error that names it when it is named (the shell's glob names every entry)
    with pytest.raises(LmforgeError, match="p5: the last validation .* did not finish"):
        fit_points([str(p) for p in sorted(sweep.iterdir())])
    # nothing to fit: the skipped paths are named in the error
    (tmp_path / "empty").mkdir()
    with pytest.raises(LmforgeError, match="no trained run to fit .*empty .*holds no run dirs"):
        run_fit([str(tmp_path / "empty"), str(sweep / "sweep.json")], samples=0, say=lambda m: None)
    with pytest.raises(LmforgeError, match="no path matches"):
        run_fit([str(tmp_path / "nothing*")], samples=0, say=lambda m: None)
