"""Mixture of experts in place of a block's MLP: a router picks top_k of n_experts SwiGLU experts per
token (Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3 style), optionally beside always-on shared experts.

    MoE.forward:  router -> (capacity dropping) -> sort assignments by expert -> experts(x_sorted, counts)
                  -> weight by the router -> scatter-add back to the tokens (+ shared experts)

`MoE.experts` (GroupedExperts) sees only tokens already grouped by expert: expert parallelism replaces
its `forward(x_sorted, counts)` with all-to-all dispatch -> local experts -> all-to-all combine and
everything else stays. Parameter names are the checkpoint format:

    moe.router.gate.weight (E, d_model), moe.router.expert_bias (E,) (bias_balancing only),
    moe.router.gate.bias (E,) (router_bias only),
    moe.experts.{w_gate, w_up} (E, d_ff, d_model), moe.experts.w_down (E, d_model, d_ff),
    moe.experts.{b_gate, b_up} (E, d_ff), moe.experts.b_down (E, d_model) (experts_bias only),
    moe.shared.{w_gate, w_up, w_down}.weight, moe.shared_gate.weight (1, d_model)

In training mode each MoE layer records its routing statistics per forward (`records`); the training
step turns them into the auxiliary losses and metrics (`router_losses`) and, with bias balancing,
into the bias update (`ExpertBias`).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.schema import ModelConfig, MoEConfig
from lmforge.models.common.mlp import MLP


class Router(nn.Module):
    """Token -> top_k experts and their weights. `forward(x (N, d_model))` returns
    (logits, scores (N, E), weights (N, top_k) in float32 or wider, experts (N, top_k) int64).

    Scores are softmax (or sigmoid) of the logits in float32, as transformers computes them; with
    bias balancing a per-expert bias is added to the scores for the choice of experts only, the
    weights stay the unbiased scores (DeepSeek-V3). With n_group > 1 a token chooses only among the
    experts of its topk_group best groups (`limit_groups`); routed_scaling multiplies the weights
    after any renormalisation (DeepSeek-V3's routed_scaling_factor)."""

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, cfg.n_experts, bias=cfg.router_bias)
        self.top_k, self.score, self.norm_topk_prob = cfg.top_k, cfg.router_score, cfg.norm_topk_prob
        self.n_group, self.topk_group, self.routed_scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling
        if cfg.bias_balancing:
            # Persistent: part of every checkpoint, so a resumed run routes exactly as before.
            self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, dtype=torch.float32))
            self.bias_update_rate = cfg.bias_update_rate
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(x)  # (N, E): the matmul in the model's dtype, the rest in float32 or wider
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()  # (N, E)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if self.n_group > 1:
            choice = limit_groups(choice, self.n_group, self.topk_group)
        experts = torch.topk(choice, self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, experts)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.routed_scaling != 1.0:
            weights = weights * self.routed_scaling
        return logits, scores, weights, experts


def limit_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3): `choice` (N, E) with every expert outside a token's
    topk_group best groups set to -inf; a group's score is the sum of its two best experts' choices."""
    N, E = choice.shape
    grouped = choice.view(N, n_group, E // n_group)  # (N, G, E/G)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)  # (N, G)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(N, E)


def _grouped_mm():
    """torch's grouped GEMM (F.grouped_mm from torch 2.10, torch._grouped_mm before), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    # CUDA only, bf16, Ampere or newer. On CPU torch 2.13's kernel runs forward but its backward fails
    # ("Invalid strides/sizes") for the transposed weight layout: the loop below serves the CPU.
    return (x.is_cuda and x.dtype == torch.bfloat16 and _grouped_mm() is not None
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


class GroupedExperts(nn.Module):
    """n_experts SwiGLU MLPs with stacked weights: w_gate, w_up (E, d_ff, d_model), w_down (E, d_model,
    d_ff) (each expert's slice is an nn.Linear weight, out x in).

    `forward(x_sorted (N, d_model), counts (E,) int64) -> (N, d_model)`: rows counts[0] come first and
    go to expert 0, the next counts[1] to expert 1, ...; returns each row's expert output, unweighted.
    The module may hold a slice of the experts (expert parallelism): E is then its local count.

    bias: per-expert biases b_gate, b_up (E, d_ff) and b_down (E, d_model). clamp (alpha, limit): the
    clamped SwiGLU `clamped_glu` in place of silu(gate) * up (gpt-oss)."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, bias: bool = False,
                 clamp: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w_up = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        if bias:
            self.b_gate = nn.Parameter(torch.empty(n_experts, d_ff))
            self.b_up = nn.Parameter(torch.empty(n_experts, d_ff))
            self.b_down = nn.Parameter(torch.empty(n_experts, d_model))
        self.has_bias, self.clamp = bias, clamp

    @torch.no_grad()
    def init_weights(self, init: str, std: float, out_std: float) -> None:
        """Each expert as the model's init treats an MLP (w_down is a residual output: out_std)."""
        for w, s in ((self.w_gate, std), (self.w_up, std), (self.w_down, out_std)):
            for e in range(w.shape[0]):
                if init == "xavier":
                    nn.init.xavier_uniform_(w[e])
                elif init == "kaiming":
                    nn.init.kaiming_normal_(w[e], mode="fan_in", nonlinearity="relu")
                else:
                    nn.init.normal_(w[e], mean=0.0, std=s)
        if self.has_bias:
            for b in (self.b_gate, self.b_up, self.b_down):
                nn.init.zeros_(b)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        biases = (self.b_gate, self.b_up, self.b_down) if self.has_bias else None
        return grouped_swiglu(x, counts, self.w_gate, self.w_up, self.w_down, biases=biases, clamp=self.clamp)


def clamped_glu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's SwiGLU: gate clamped to <= limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha *
    gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _glu(gate: torch.Tensor, up: torch.Tensor, clamp: tuple[float, float] | None) -> torch.Tensor:
    return F.silu(gate) * up if clamp is None else clamped_glu(gate, up, *clamp)


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor, biases: tuple[torch.Tensor, ...] | None = None,
                   clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """GroupedExperts' maths on explicit weights (expert parallelism passes a rank's local shards):
    rows grouped by expert, `counts` (E,) of them for the E experts of the weights; `biases` (b_gate,
    b_up, b_down) and `clamp` as GroupedExperts takes them."""
    assert counts.shape == (w_gate.shape[0],), (counts.shape, w_gate.shape)
    if _grouped_mm_ok(x):
        # One kernel per projection over all groups (Hopper+); offs = end row of each group.
        gmm, offs = _grouped_mm(), torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = gmm(x, w_gate.transpose(-2, -1), offs=offs), gmm(x, w_up.transpose(-2, -1), offs=offs)
        if biases is not None:
            # Each row's expert; output_size keeps repeat_interleave from reading counts on the host.
            row_expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts,
                                                 output_size=x.shape[0])
            gate, up = gate + biases[0][row_expert], up + biases[1][row_expert]
        out = gmm(_glu(gate, up, clamp), w_down.transpose(-2, -1), offs=offs)  # (N, d_model)
        return out if biases is None else out + biases[2][row_expert]
    outs = []
    # One GEMM for gate and up: twice the width per call ran 1.5x faster on the CPU here than two
    # calls (measured, d 512 -> 2 x 1024, 512 rows). unbind, not w[e]: the backward of one unbind
    # stacks the experts' gradients once, where indexing would add a zero-filled (E, ...) gradient
    # per expert. Every expert runs, also on zero rows: its weights get zero gradients rather than
    # none, so data-parallel wrappers and optimizers see the same parameters every step.
    w_gate_up = torch.cat([w_gate, w_up], dim=1)  # (E, 2 * d_ff, d_model)
    E = w_gate.shape[0]
    b_gate_up = [None] * E if biases is None else torch.cat(biases[:2], dim=1).unbind(0)  # (2 * d_ff,) each
    b_down = [None] * E if biases is None else biases[2].unbind(0)
    for chunk, w_gu, b_gu, w_d, b_d in zip(x.split(counts.tolist()), w_gate_up.unbind(0), b_gate_up,
                                           w_down.unbind(0), b_down):
        gate, up = F.linear(chunk, w_gu, b_gu).chunk(2, dim=-1)  # (n_e, d_ff) each
        outs.append(F.linear(_glu(gate, up, clamp), w_d, b_d))  # (n_e, d_model)
    return torch.cat(outs)


def expert_d_ff(cfg: ModelConfig) -> int:
    """Hidden size of one routed expert."""
    return cfg.moe.d_ff_expert or cfg.resolved_d_ff


def shared_d_ff(cfg: ModelConfig) -> int:
    """Hidden size of the shared experts together (0 without any)."""
    m = cfg.moe
    return m.n_shared_experts * (m.shared_d_ff or expert_d_ff(cfg))


class MoE(nn.Module):
    """`moe(x (B, T, d_model)) -> (B, T, d_model)`: sum over a token's top_k experts of weight * expert(x),
    plus the shared experts (times sigmoid(shared_gate(x)) with shared_gate).

    With capacity_factor, each expert takes at most ceil(capacity_factor * tokens * top_k / E)
    assignments per forward. Which ones: assignments in the order of the flattened (batch, position)
    tokens, a token's slots in top-k order; the first `capacity` of an expert stay, the rest are
    dropped (they add nothing; the token keeps its residual and any other expert's output).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.moe
        assert m is not None
        self.cfg = m
        self.n_experts, self.top_k, self.capacity_factor = m.n_experts, m.top_k, m.capacity_factor
        self.router = Router(cfg.d_model, m)
        clamp = (m.swiglu_alpha, m.swiglu_limit) if m.expert_act == "clamped_swiglu" else None
        self.experts = GroupedExperts(m.n_experts, cfg.d_model, expert_d_ff(cfg), m.experts_bias, clamp)
        if m.n_shared_experts:
            shared = cfg.model_copy(update={"d_ff": shared_d_ff(cfg), "mlp": "swiglu", "bias": False})
            self.shared = MLP(shared)
            if m.shared_gate:
                self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False)
        self.records: list[RouterRecord] = []

    def capacity(self, n_tokens: int) -> int | None:
        """Assignments one expert takes per forward of n_tokens tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        N, k, E = flat.shape[0], self.top_k, self.n_experts
        logits, scores, weights, experts = self.router(flat)  # (N, E), (N, E), (N, k), (N, k)
        assigned = experts.reshape(-1)  # (N*k,): assignment a is token a // k, slot a % k
        # A stable sort keeps the assignments of one expert in token order: the capacity rule's order.
        order = torch.argsort(assigned, stable=True)  # (N*k,)
        routed = torch.bincount(assigned, minlength=E)  # (E,)
        counts = routed
        cap = self.capacity(N)
        if cap is not None:
            starts = torch.cumsum(routed, 0) - routed  # (E,) first sorted position of each expert
            rank = torch.arange(N * k, device=x.device) - starts[assigned[order]]  # place within its expert
            order = order[rank < cap]  # (M,)
            counts = routed.clamp(max=cap)
        token = order // k  # (M,)
        y = self.experts(flat[token], counts)  # (M, d)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        # Summed in the wider of the input's and the experts' dtypes (fp32 under bf16 autocast), as the
        # residual stream's adds are.
        out = torch.zeros_like(flat, dtype=torch.promote_types(flat.dtype, y.dtype))
        out.index_add_(0, token, y.to(out.dtype))  # (N, d)
        if hasattr(self, "shared"):
            s = self.shared(flat)
            if hasattr(self, "shared_gate"):
                s = torch.sigmoid(self.shared_gate(flat)) * s
            out = out + s
        if self.training and torch.is_grad_enabled():
            self.records.append(_record(logits, scores, routed, counts, k, self.router.score))
        return out.view(shape)


@dataclass
class RouterRecord:
    """One MoE layer's routing in one training forward."""

    f: torch.Tensor  # (E,) assignments per token to each expert (sums to top_k), before capacity
    p: torch.Tensor  # (E,) mean router probability of each expert
    z: torch.Tensor  # () mean over tokens of logsumexp(logits)^2
    entropy: torch.Tensor  # () mean router entropy per token, nats (detached)
    routed: torch.Tensor  # (E,) assignments per expert before capacity (detached; bias balancing)
    dropped: torch.Tensor  # () fraction of assignments dropped by the capacity (detached)


def _record(logits, scores, routed, kept, k: int, score: str) -> RouterRecord:
    N = logits.shape[0]
    # Sigmoid scores are normalised per token for P, as DeepSeek-V3's balance loss does.
    probs = scores if score == "softmax" else scores / scores.sum(-1, keepdim=True)  # (N, E)
    with torch.no_grad():
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()
        dropped = 1.0 - kept.sum().float() / max(N * k, 1)
    return RouterRecord(
        f=routed.float() / max(N, 1), p=probs.mean(0), z=torch.logsumexp(logits, -1).square().mean(),
        entropy=entropy, routed=routed.detach(), dropped=dropped,
    )


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE modules of `model` (wrappers included), in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def clear_records(layers: list[MoE]) -> None:
    """Forget recorded routing (a training step calls this before each micro-batch's forward)."""
    for m in layers:
        m.records.clear()


@dataclass
class RouterLosses:
    loss: torch.Tensor  # () aux_loss_coef * balance + z_loss_coef * z: what training adds per target
    metrics: dict[str, torch.Tensor]  # unweighted values, each a () tensor (means per token)


def router_losses(layers: list[MoE]) -> RouterLosses | None:
    """The auxiliary losses and router statistics of the forwards recorded since `clear_records`
    (None when nothing was recorded: eval mode, no grad, or a dense model).

    balance (metric moe_aux_loss): E * sum_i f_i * P_i, transformers' load_balancing_loss_func
    normalisation (top_k when perfectly balanced). aux_loss_scope=layer: per layer, averaged over
    layers; model: f and P pooled over the layers first (transformers' aggregation). Several forwards
    of one micro-batch (a preference pair) count as that many samples, averaged.
    z (moe_z_loss): mean over tokens of logsumexp(logits)^2, averaged over layers and forwards.
    Statistics: moe_load_max / moe_load_min (the busiest / idlest expert's share of assignments
    times E / top_k, over all layers: 1.0 = uniform), moe_drop_frac, moe_router_entropy (nats).
    Padding positions are routed and counted like any token.
    """
    per_layer = [m.records for m in layers if m.records]
    if not per_layer:
        return None
    cfg = layers[0].cfg
    E, k = cfg.n_experts, cfg.top_k
    n = min(len(r) for r in per_layer)
    assert all(len(r) == n for r in per_layer), "MoE layers recorded different numbers of forwards"
    recs = [rec for r in per_layer for rec in r]
    if cfg.aux_loss_scope == "layer":
        balance = torch.stack([E * (r.f * r.p).sum() for r in recs]).mean()
    else:
        pooled = []
        for j in range(n):
            f = torch.stack([r[j].f for r in per_layer]).mean(0)
            p = torch.stack([r[j].p for r in per_layer]).mean(0)
            pooled.append(E * (f * p).sum())
        balance = torch.stack(pooled).mean()
    z = torch.stack([r.z for r in recs]).mean()
    loss = balance * cfg.aux_loss_coef + z * cfg.z_loss_coef
    loads = torch.stack([r.f.detach() for r in recs]) * (E / k)  # (records, E)
    metrics = {
        "moe_aux_loss": balance.detach(),
        "moe_z_loss": z.detach(),
        "moe_load_max": loads.max(),
        "moe_load_min": loads.min(),
        "moe_drop_frac": torch.stack([r.dropped for r in recs]).mean(),
        "moe_router_entropy": torch.stack([r.entropy for r in recs]).mean(),
    }
    return RouterLosses(loss, metrics)


# model -> its MoE layers that balance by bias (the model's structure does not change while it trains)
_BIASED_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ExpertBias:
    """Aux-loss-free balancing (DeepSeek-V3, torchtitan): the step observes each balancing router's
    load after every micro-batch's forward, and after an applied optimizer step moves its bias by
    rate * sign(mean load - load), with the load summed over the step and the data-parallel ranks
    (so every replica makes the same update). Only routers whose gate weight trains move their bias."""

    def __init__(self, layers: list[MoE]) -> None:
        self.layers = layers
        self.load: list[torch.Tensor | None] = [None] * len(layers)

    @classmethod
    def of(cls, model: nn.Module) -> ExpertBias | None:
        """The balancer for `model`, or None when no router of it balances by bias. Asked every step: the
        walk over the model's modules is done once per model."""
        layers = _BIASED_LAYERS.get(model)
        if layers is None:
            # A router whose gate does not train itself (frozen, or a frozen base under adapters) keeps its
            # bias too: it is part of the base model that the adapters are trained against.
            layers = [m for m in moe_layers(model) if m.router.expert_bias is not None
                      and isinstance(m.router.gate, nn.Linear) and m.router.gate.weight.requires_grad]
            _BIASED_LAYERS[model] = layers
        return cls(layers) if layers else None

    def observe(self) -> None:
        """Add the loads recorded by the forward that just ran."""
        for i, m in enumerate(self.layers):
            for r in m.records:
                self.load[i] = r.routed.float() if self.load[i] is None else self.load[i] + r.routed

    @torch.no_grad()
    def update(self, all_reduce=lambda t: t) -> None:
        """Move every bias once; `all_reduce` sums a tensor over the data-parallel ranks."""
        for m, load in zip(self.layers, self.load):
            if load is None:
                continue
            load = all_reduce(load)
            bias = m.router.expert_bias
            bias += m.router.bias_update_rate * torch.sign(load.mean() - load).to(bias.dtype)
        self.load = [None] * len(self.layers)
