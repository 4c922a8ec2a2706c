"""Expert parallelism (parallel.ep) on 2 and 4 real gloo processes equals one process.

A tiny mixture-of-experts model (4 experts, top-2, SwiGLU experts beside a shared expert) trains 3
steps with 2 accumulated micro-batches and an active clip. Its experts are split over ep ranks
(DTensor shards) and tokens travel to them by all-to-all; the other parameters are DDP or FSDP
over all ranks. Each layout must equal the single-process train_step on the same global batch:

  ep 2 over 2 ranks, with DDP and with FSDP ZeRO-3 (+ activation checkpointing);
  ep 2 over 4 ranks (2 expert groups, whose expert gradients are summed across them), FSDP;
  ep 4 over 4 ranks, DDP (one expert per rank); ep 2 beside HSDP (2 replicas x 2 shards).

Checkpoints: an ep 2 FSDP run saves after 2 steps (each rank writes its experts' shards); 4 ranks
with ep 4 and one plain process each resume it for steps 2-3 and must equal 4 uninterrupted steps.

Routing: dropless, and no auxiliary losses in these comparisons: a load-balancing loss is a
product of per-batch means, so a data-parallel run (each rank balancing its own tokens, as in
Megatron and torchtitan) legitimately differs from one process on the whole batch. With the aux
and z losses on, expert-parallel DDP must instead equal plain DDP on the same ranks (the same
per-rank losses), which pins that ep changes nothing but where experts run.

Tolerances as tests/distributed/test_two_ranks.py (fp32): losses 1e-5 absolute, gradient norms
1e-5 relative, parameters 1e-5 after AdamW and 1e-7 after SGD (lr 0.5, momentum 0.9, whose update
is proportional to the gradient, so a wrong expert-gradient sum or scale cannot hide).
"""

from __future__ import annotations

import pytest
from dist_harness import assert_matches, launch, merged_params, reference, selected
from safetensors.torch import load_file

# Slow tier (CI runs it): ~25 s of launches; expert parallelism stays in the default tier through
# test_family_gpt_oss_ep.py.
pytestmark = pytest.mark.slow

LOSS_TOL, NORM_RTOL, PARAM_TOL, SGD_PARAM_TOL = 1e-5, 1e-5, 1e-5, 1e-7
SGD = {"name": "sgd", "lr": 0.5, "sgd": {"momentum": 0.9}}
MOE = {"moe": {"n_experts": 4, "top_k": 2, "d_ff_expert": 48, "n_shared_experts": 1, "shared_gate": True,
               "aux_loss_coef": 0.0, "z_loss_coef": 0.0}}
MOE_AUX = {"moe": {**MOE["moe"], "aux_loss_coef": 0.01, "z_loss_coef": 1e-3}}

TWO = [
    dict(name="ep2_ddp", parallel={"dp_replicate": 2, "ep": 2}, model=MOE),
    dict(name="ep2_ddp_sgd", parallel={"dp_replicate": 2, "ep": 2}, model=MOE, optim=SGD,
         export="{tmp}/ep2.safetensors"),
    dict(name="ep2_fsdp_ac", parallel={"dp_shard": 2, "ep": 2}, model=MOE,
         train={"activation_checkpointing": "full"}),
    dict(name="ep2_fsdp_sgd", parallel={"dp_shard": 2, "ep": 2}, model=MOE, optim=SGD),
    dict(name="ep2_ddp_aux", parallel={"dp_replicate": 2, "ep": 2}, model=MOE_AUX, optim=SGD),
    dict(name="ddp_aux", parallel={"dp_replicate": 2}, model=MOE_AUX, optim=SGD),
    # Trains steps 0-1 and saves: the experts go into the checkpoint as ep shards.
    dict(name="ep2_fsdp_save", parallel={"dp_shard": 2, "ep": 2}, model=MOE, steps=2, save_at=2,
         save_dir="{tmp}/save"),
]
FOUR = [
    dict(name="ep2_edp2_fsdp", parallel={"dp_shard": 4, "ep": 2}, model=MOE),
    dict(name="ep2_edp2_fsdp_sgd", parallel={"dp_shard": 4, "ep": 2}, model=MOE, optim=SGD),
    dict(name="ep4_ddp_sgd", parallel={"dp_replicate": 4, "ep": 4}, model=MOE, optim=SGD),
    dict(name="ep2_hsdp_sgd", parallel={"dp_replicate": 2, "dp_shard": 2, "ep": 2}, model=MOE, optim=SGD),
    # Resumes that checkpoint in another expert split (one expert per rank) for steps 2-3.
    dict(name="resume_ep4", parallel={"dp_replicate": 4, "ep": 4}, model=MOE, steps=2, first_step=2,
         load_dir="{tmp}/save/checkpoints/step_00000002"),
]
CKPT = "save/checkpoints/step_00000002"
for s in TWO + FOUR:
    s.setdefault("steps", 3)
    s.setdefault("rows", 4)


# Slow tier: SGD layouts of 4 ranks whose pieces the default tier checks: 2 expert groups over FSDP
# (ep2_edp2_fsdp, after AdamW), ep 4 DDP (resume_ep4 trains in it), HSDP (test_four_ranks' hsdp).
SLOW = {"ep2_edp2_fsdp_sgd", "ep4_ddp_sgd", "ep2_hsdp_sgd"}
NEEDS = {"test_expert_parallel_equals_plain_data_parallel_with_router_losses": ("ep2_ddp_aux", "ddp_aux"),
         "test_expert_parallel_checkpoint_resumes_in_another_split_and_in_one_process": ("ep2_fsdp_save",
                                                                                          "resume_ep4"),
         "test_each_rank_holds_only_its_experts": ("ep2_ddp_sgd",)}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """A launch of 2 ranks, then one of 4, for the scenarios that the selected tests check."""
    tests = selected(request)
    names = {p["name"] for f, p in tests if f == "test_expert_parallel_equals_single_process"}
    names |= {n for f, _ in tests for n in NEEDS.get(f, ())}
    tmp = tmp_path_factory.mktemp("ep")
    paths = ("export", "save_dir", "load_dir")

    def fill(specs):
        return [{k: (v.format(tmp=tmp) if k in paths else v) for k, v in s.items()} for s in specs
                if s["name"] in names]

    out = {}
    for n, specs, sub in ((2, fill(TWO), "two"), (4, fill(FOUR), "four")):
        if specs:  # the 2-rank launch first: it writes the checkpoint that resume_ep4 loads
            out.update(launch(n, specs, tmp / sub))
    return out, tmp


@pytest.mark.parametrize("name", [pytest.param(s["name"], marks=pytest.mark.slow) if s["name"] in SLOW
                                  else s["name"] for s in TWO + FOUR if "aux" not in s["name"]
                                  and "save" not in s and "load_dir" not in s])
def test_expert_parallel_equals_single_process(runs, name):
    spec = next(s for s in TWO + FOUR if s["name"] == name)
    tol = SGD_PARAM_TOL if spec.get("optim") == SGD else PARAM_TOL
    assert_matches(runs[0][name], reference(spec), LOSS_TOL, NORM_RTOL, tol)


def test_expert_parallel_equals_plain_data_parallel_with_router_losses(runs):
    ep, plain = runs[0]["ep2_ddp_aux"], runs[0]["ddp_aux"]
    for r in ep + plain:
        assert "error" not in r, r.get("trace")
    # Both differ from one process (per-rank balance losses) by the same amount: the router losses are
    # really on, and ep reproduces data parallelism's losses, norms and weights.
    ref = reference(next(s for s in TWO if s["name"] == "ddp_aux"))
    assert abs(plain[0]["losses"][0] - ref["losses"][0]) > 1e-6
    for a, b in zip(ep, plain):
        assert a["losses"] == pytest.approx(b["losses"], abs=LOSS_TOL)
        assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=NORM_RTOL)
    full_ep, full_plain = merged_params(ep), merged_params(plain)
    assert max((full_ep[k] - v).abs().max().item() for k, v in full_plain.items()) <= SGD_PARAM_TOL


@pytest.fixture(scope="module")
def continuous():
    """4 uninterrupted single-process steps; steps 2-3 are what every resumed run must give."""
    ref = reference({"model": MOE}, steps=4)
    return {**ref, "losses": ref["losses"][2:], "grad_norms": ref["grad_norms"][2:]}


def test_expert_parallel_checkpoint_resumes_in_another_split_and_in_one_process(runs, continuous):
    assert_matches(runs[0]["resume_ep4"], continuous, LOSS_TOL, NORM_RTOL, PARAM_TOL)
    resumed = reference({"model": MOE}, steps=2, load_dir=runs[1] / CKPT, first_step=2)
    assert_matches([resumed], continuous, LOSS_TOL, NORM_RTOL, PARAM_TOL)


def test_each_rank_holds_only_its_experts(runs):
    """The consolidated export has every expert; the ranks' own shards are halves."""
    full = load_file(str(runs[1] / "ep2.safetensors"))
    ref = reference(next(s for s in TWO if s["name"] == "ep2_ddp_sgd"))
    names = [k for k in full if ".experts." in k]
    assert names and all(full[k].shape[0] == 4 for k in names)
    assert max((full[k] - ref["params"][k]).abs().max().item() for k in full) <= SGD_PARAM_TOL
    for r in runs[0]["ep2_ddp_sgd"]:
        assert all(v.shape[0] == 2 for k, v in r["local_experts"].items())


def test_bad_ep_layouts_fail_at_startup():
    from lmforge.config.schema import Config
    from lmforge.errors import ConfigError
    from lmforge.parallel.dims import ParallelDims

    def resolve(parallel, model=MOE, world=4):
        cfg = Config.model_validate({"model": {"d_model": 64, "n_heads": 4, "vocab_size": 128, **model},
                                     "parallel": parallel})
        return ParallelDims.resolve(cfg.parallel, world, cfg.model)

    with pytest.raises(ConfigError, match="parallel.ep=3 must divide"):
        resolve({"dp_shard": 4, "ep": 3})
    with pytest.raises(ConfigError, match="model.moe is not set"):
        resolve({"dp_shard": 4, "ep": 2}, model={})
    with pytest.raises(ConfigError, match="n_experts=4 is not divisible by parallel.ep=8"):
        resolve({"dp_shard": 8, "ep": 8}, world=8)
    with pytest.raises(ConfigError, match="beside data parallelism only"):
        resolve({"dp_shard": 2, "tp": 2, "ep": 2})
    with pytest.raises(ConfigError, match="zero=1"):
        resolve({"dp_shard": 4, "zero": 1, "ep": 2})
