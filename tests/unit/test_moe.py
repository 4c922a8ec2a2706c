"""The mixture-of-experts layer (models/moe.py): routing against a naive per-token loop in float64,
capacity dropping, the auxiliary losses and their gradients, bias balancing, the expert-parallel
contract of GroupedExperts, and the training step's handling of the router losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.config.schema import ModelConfig, ParallelConfig
from lmforge.data.batch import TokenBatch
from lmforge.engine.objectives import CausalLM
from lmforge.engine.objectives.base import objective_forward
from lmforge.engine.precision import Precision
from lmforge.engine.step import train_step
from lmforge.errors import ConfigError
from lmforge.models.flops import count_params, flops_per_token
from lmforge.models.moe import ExpertBias, GroupedExperts, MoE, clear_records, moe_layers, router_losses
from lmforge.models.transformer import build_model
from lmforge.parallel.dims import ParallelDims

D = 16
FP32 = Precision("fp32", torch.device("cpu"))


def _cfg(**moe) -> ModelConfig:
    base = dict(n_experts=4, top_k=2, d_ff_expert=24)
    return ModelConfig(vocab_size=50, d_model=D, n_layers=2, n_heads=2, max_seq_len=32, moe={**base, **moe})


def _layer(seed: int = 0, dtype=torch.float64, **moe) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(_cfg(**moe)).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return layer


def _naive(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: scores, top-k, each chosen expert's SwiGLU times its weight (+ shared)."""
    cfg, ex = layer.cfg, layer.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = layer.router.gate.weight @ x[t]  # (E,)
        scores = logits.softmax(-1) if cfg.router_score == "softmax" else logits.sigmoid()
        top = torch.topk(scores, cfg.top_k).indices
        w = scores[top] / (scores[top].sum() if cfg.norm_topk_prob else 1.0)
        for e, we in zip(top.tolist(), w):
            h = F.silu(ex.w_gate[e] @ x[t]) * (ex.w_up[e] @ x[t])
            out[t] += we * (ex.w_down[e] @ h)
        if hasattr(layer, "shared"):
            s = layer.shared.w_down.weight @ (F.silu(layer.shared.w_gate.weight @ x[t])
                                              * (layer.shared.w_up.weight @ x[t]))
            if hasattr(layer, "shared_gate"):
                s = torch.sigmoid(layer.shared_gate.weight @ x[t]) * s
            out[t] += s
    return out


@pytest.mark.parametrize("moe", [
    {},
    {"router_score": "sigmoid", "norm_topk_prob": False, "top_k": 3},
    {"n_shared_experts": 2, "shared_d_ff": 8, "shared_gate": True, "norm_topk_prob": False},
    {"top_k": 1, "norm_topk_prob": False},
])
def test_routing_equals_a_per_token_loop_in_float64(moe):
    layer = _layer(**moe)
    x = torch.randn(3, 7, D, dtype=torch.float64)
    got = layer(x)  # (B, T, D)
    want = _naive(layer, x.reshape(-1, D)).reshape(3, 7, D)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_capacity_drops_the_later_tokens_of_an_overfull_expert():
    # top-1 with every token preferring expert 2 (a large gate row): capacity ceil(0.5 * 10 * 1 / 4) = 2.
    layer = _layer(top_k=1, norm_topk_prob=False, capacity_factor=0.5)
    with torch.no_grad():
        layer.router.gate.weight.zero_()
        layer.router.gate.weight[2] = 1.0
    x = torch.rand(1, 10, D, dtype=torch.float64) + 0.1  # positive: every token scores expert 2 highest
    assert layer.capacity(10) == 2
    layer.train()
    out = layer(x)[0]
    full = _naive(layer, x[0])
    torch.testing.assert_close(out[:2], full[:2], rtol=0, atol=1e-12)  # the first two tokens keep theirs
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))  # the overflow adds nothing (residual only)
    rec = layer.records[-1]
    assert rec.dropped.item() == pytest.approx(0.8)
    assert rec.routed.tolist() == [0, 0, 10, 0]  # the load counts what the router chose, before dropping


def test_capacity_keeps_a_tokens_other_expert_and_none_is_dropless():
    layer = _layer(top_k=2, capacity_factor=1.0)
    x = torch.randn(2, 9, D, dtype=torch.float64)
    cap = layer.capacity(18)
    assert cap == math.ceil(1.0 * 18 * 2 / 4)
    out = layer(x).reshape(-1, D)
    # Rebuild which assignments survive by the documented rule and compare with a masked naive sum.
    flat = x.reshape(-1, D)
    _, _, w, idx = layer.router(flat)
    seen = [0] * 4
    want = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for slot in range(2):
            e = int(idx[t, slot])
            seen[e] += 1
            if seen[e] <= cap:
                ex = layer.experts
                h = F.silu(ex.w_gate[e] @ flat[t]) * (ex.w_up[e] @ flat[t])
                want[t] += w[t, slot] * (ex.w_down[e] @ h)
    assert max(seen) > cap  # the case dropped something
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    dropless = _layer(top_k=2)
    dropless.load_state_dict(layer.state_dict())
    assert dropless.capacity(18) is None
    torch.testing.assert_close(dropless(x).reshape(-1, D), _naive(dropless, flat), rtol=0, atol=1e-12)


def test_grouped_experts_on_a_slice_equal_the_full_ones_rows():
    torch.manual_seed(0)
    full = GroupedExperts(6, D, 12)
    torch.nn.init.normal_(full.w_gate), torch.nn.init.normal_(full.w_up), torch.nn.init.normal_(full.w_down)
    counts = torch.tensor([3, 0, 5, 2, 1, 4])
    x = torch.randn(int(counts.sum()), D)
    y = full(x, counts)
    part = GroupedExperts(3, D, 12)  # experts 2..4 of the six, as one expert-parallel rank holds them
    part.load_state_dict({k: v[2:5] for k, v in full.state_dict().items()})
    lo, hi = int(counts[:2].sum()), int(counts[:5].sum())
    torch.testing.assert_close(part(x[lo:hi], counts[2:5]), y[lo:hi], rtol=0, atol=0)
    y.sum().backward()  # an expert without tokens gets a zero gradient, not None
    assert full.w_gate.grad is not None and torch.equal(full.w_gate.grad[1], torch.zeros(12, D))


def test_balance_and_z_loss_values():
    layer = _layer(top_k=2, dtype=torch.float32)
    layer.train()
    x = torch.randn(2, 8, D)
    layer(x)
    flat = x.reshape(-1, D)
    logits = flat @ layer.router.gate.weight.T  # (N, E)
    probs = logits.softmax(-1)
    chosen = torch.topk(probs, 2).indices
    f = torch.bincount(chosen.reshape(-1), minlength=4).float() / flat.shape[0]
    want_balance = 4 * (f * probs.mean(0)).sum()
    want_z = torch.logsumexp(logits, -1).square().mean()
    got = router_losses([layer])
    assert got.metrics["moe_aux_loss"].item() == pytest.approx(want_balance.item(), rel=1e-6)
    assert got.metrics["moe_z_loss"].item() == pytest.approx(want_z.item(), rel=1e-6)
    coef = layer.cfg
    assert got.loss.item() == pytest.approx(coef.aux_loss_coef * want_balance.item()
                                            + coef.z_loss_coef * want_z.item(), rel=1e-6)
    entropy = -(probs * probs.log()).sum(-1).mean()
    assert got.metrics["moe_router_entropy"].item() == pytest.approx(entropy.item(), rel=1e-5)
    assert got.metrics["moe_load_max"].item() == pytest.approx((f.max() * 4 / 2).item())


def test_aux_loss_gives_the_router_a_gradient():
    layer = _layer(top_k=2, dtype=torch.float32, z_loss_coef=1e-3)
    layer.train()
    layer(torch.randn(2, 8, D))
    router_losses([layer]).loss.backward()
    assert layer.router.gate.weight.grad is not None and layer.router.gate.weight.grad.abs().sum() > 0
    assert layer.experts.w_up.grad is None  # the aux loss touches the router only


def test_nothing_is_recorded_in_eval_mode_or_without_grad():
    layer = _layer(dtype=torch.float32)
    layer.eval()
    layer(torch.randn(1, 4, D))
    layer.train()
    with torch.no_grad():
        layer(torch.randn(1, 4, D))
    assert layer.records == [] and router_losses([layer]) is None


def test_bias_balancing_moves_the_load_toward_uniform():
    layer = _layer(dtype=torch.float32, top_k=1, norm_topk_prob=False, bias_balancing=True,
                   bias_update_rate=0.05)
    with torch.no_grad():
        layer.router.gate.weight[0] += 1.0  # skew: expert 0 wins most tokens
    layer.train()
    torch.manual_seed(1)
    x = torch.randn(4, 16, D).abs()

    def load() -> torch.Tensor:
        clear_records([layer])
        layer(x)
        return layer.records[-1].routed.float()

    before = load()
    assert before[0] > 0.5 * before.sum()
    for _ in range(40):
        balance = ExpertBias([layer])
        clear_records([layer])
        layer(x)
        balance.observe()
        balance.update()
    after = load()
    assert after.max() - after.min() < 0.5 * (before.max() - before.min())
    assert layer.router.expert_bias[0] < 0  # the busy expert's bias went down
    # The bias only picks experts: the weights are still the unbiased (here top-1 raw) scores.
    _, scores, w, idx = layer.router(x.reshape(-1, D))
    torch.testing.assert_close(w, scores.gather(-1, idx))


def _model(seed=0, **moe) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(_cfg(**moe))


def _batch(seed=0) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (2, 12), generator=g)
    return TokenBatch(ids[:, :-1], ids[:, 1:])


def test_objective_forward_adds_the_aux_loss_once_per_target():
    model = _model(z_loss_coef=1e-3)
    model.train()
    batch, objective = _batch(), CausalLM()
    for m in moe_layers(model):
        m.records.append(None)  # stale: what an evaluation or a checkpoint recompute left behind
    out = objective_forward(model, objective, batch)
    assert all(len(m.records) == 1 for m in moe_layers(model))  # cleared first, then one forward each
    aux = router_losses(moe_layers(model))
    plain = objective(model, batch).loss  # same weights: the same routing and logits
    n = objective.num_targets(batch)
    assert out.loss.item() == pytest.approx(plain.item() + aux.loss.item() * n, rel=1e-6)
    want = aux.metrics["moe_aux_loss"].item() * n
    assert out.metrics["moe_aux_loss"].item() == pytest.approx(want, rel=1e-6)


class _KeepGrads(torch.optim.SGD):
    """An optimizer that changes nothing and keeps the step's gradients (by unwrapped name)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model.parameters(), lr=0.0)
        self.names = {p: n.replace("_checkpoint_wrapped_module.", "") for n, p in model.named_parameters()}
        self.kept: dict[str, torch.Tensor] = {}

    def step(self, closure=None):
        self.kept = {self.names[p]: p.grad.clone() for p in self.names if p.grad is not None}


def test_train_step_reports_router_metrics_and_activation_checkpointing_agrees():
    from lmforge.parallel.checkpointing import apply_activation_checkpointing

    grads = []
    for ac in ("none", "full"):
        model = _model(z_loss_coef=1e-3)
        apply_activation_checkpointing(model, ac, 1)
        opt = _KeepGrads(model)
        result = train_step(model, [_batch(0), _batch(1)], opt, FP32)
        assert {"moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_drop_frac"} <= set(result.metrics)
        grads.append(opt.kept)
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-5, atol=1e-7)


def test_train_step_updates_the_expert_bias_after_the_optimizer_step():
    model = _model(bias_balancing=True, bias_update_rate=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_step(model, [_batch(0)], opt, FP32)
    bias = model.layers[0].moe.router.expert_bias
    assert bias.abs().max().item() == pytest.approx(0.01)  # each expert moved by +-rate (or 0 at the mean)
    assert "layers.0.moe.router.expert_bias" in model.state_dict()  # persistent: resumes exactly


def test_parameter_counts_and_active_flops():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, qk_norm=True, tie_embeddings=False,
                      moe=dict(n_experts=8, top_k=2, d_ff_expert=40, n_shared_experts=1, shared_d_ff=24,
                               shared_gate=True))
    model = build_model(cfg, "meta")
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    per_expert = 3 * 32 * 40
    assert count_params(cfg) - count_params(cfg, active=True) == 2 * (8 - 2) * per_expert
    dense_like = cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"n_experts": 2})})
    # FLOPs follow the active weights: 8 experts at top-2 cost what 2 experts at top-2 cost, plus the router.
    assert flops_per_token(cfg, 16) - flops_per_token(dense_like, 16) == 6 * 2 * 32 * (8 - 2)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="moe.top_k=5 exceeds moe.n_experts=4"):
        _cfg(top_k=5)
    with pytest.raises(ValueError, match="shared_gate"):
        _cfg(shared_gate=True)
    dims = ParallelDims.resolve(ParallelConfig(pp=2, dp_shard=1), 2, grad_accum_steps=2)
    with pytest.raises(ConfigError, match="parallel.pp=2 with model.moe"):
        dims.check_model(_cfg())
    dims = ParallelDims.resolve(ParallelConfig(tp=2, dp_shard=1), 2)
    with pytest.raises(ConfigError, match="parallel.tp=2 with model.moe"):
        dims.check_model(_cfg())
    with pytest.raises(ConfigError, match="parallel.tp=2 with model.qk_norm"):
        dims.check_model(ModelConfig(vocab_size=50, d_model=D, n_heads=2, qk_norm=True))


def test_bf16_autocast_trains_and_tracks_fp32():
    """Under CPU bf16 autocast the experts run in bf16 but their outputs are summed in fp32 (the
    residual's dtype): the forward and backward run, and the logits stay within bf16 rounding of the
    fp32 model's (measured max |diff| 0.0045 on logits up to 1.56; bound 0.02)."""
    from lmforge.config.schema import ModelConfig
    from lmforge.models import build_model

    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32,
                      moe={"n_experts": 4, "top_k": 2, "n_shared_experts": 1, "shared_gate": True})
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().square().mean().backward()
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max().item() < 0.02
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
