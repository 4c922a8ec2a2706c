"""gpt-oss's blocks under expert parallelism on 2 real gloo processes equal one process: experts with
biases and the clamped SwiGLU split over the ranks (their biases sharded with their weights), a router
with a bias and attention sinks replicated. Same tolerances and routing settings as
test_expert_parallel.py (dropless, no auxiliary losses); SGD, whose update is proportional to the
gradient, so a bias gradient lost or summed twice cannot hide; the biases start at zero and move in step
one, so the later steps run with them."""

from __future__ import annotations

import pytest
from dist_harness import assert_matches, launch, reference

LOSS_TOL, NORM_RTOL, SGD_PARAM_TOL = 1e-5, 1e-5, 1e-7
SGD = {"name": "sgd", "lr": 0.5, "sgd": {"momentum": 0.9}}
GPT_OSS = {"bias": True, "attn_sinks": True,
           "moe": {"n_experts": 4, "top_k": 2, "d_ff_expert": 48, "router_bias": True, "experts_bias": True,
                   "expert_act": "clamped_swiglu", "swiglu_alpha": 1.702, "swiglu_limit": 1.0,
                   "aux_loss_coef": 0.0, "z_loss_coef": 0.0}}
SPECS = [
    dict(name="ep2_ddp_sgd", parallel={"dp_replicate": 2, "ep": 2}),
    dict(name="ep2_fsdp_sgd", parallel={"dp_shard": 2, "ep": 2}),
]
for s in SPECS:
    s.update(model=GPT_OSS, optim=SGD, steps=3, rows=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch(2, SPECS, tmp_path_factory.mktemp("gpt_oss_ep"))


@pytest.mark.parametrize("name", [s["name"] for s in SPECS])
def test_gpt_oss_experts_split_over_ranks_equal_one_process(runs, name):
    spec = next(s for s in SPECS if s["name"] == name)
    ref = reference(spec)
    assert any(k.endswith("experts.b_down") and v.abs().max() > 0 for k, v in ref["params"].items())
    assert_matches(runs[name], ref, LOSS_TOL, NORM_RTOL, SGD_PARAM_TOL)
