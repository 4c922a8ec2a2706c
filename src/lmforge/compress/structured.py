"""Structured pruning: whole attention heads and MLP hidden channels removed, the same number in every
layer, so that the result is a smaller dense Transformer with an ordinary ModelConfig (fewer heads,
a smaller d_ff, head_dim kept explicit) that runs faster everywhere, with no sparse kernels.

Heads go by key/value group. With grouped-query attention query head h reads kv head h // G (G =
n_heads / n_kv_heads, as SDPA's enable_gqa); removing a kv head means removing the G query heads that
read it, so a group is the unit: the model keeps its group size, its KV cache shrinks with it, and
the result is still a GQA model any GQA runtime loads. (The other choice, dropping query heads inside
every group, keeps the KV cache and wk/wv whole and changes the group size; Minitron / LLM-Pruner prune
Llama-3's GQA by groups too.) Without GQA (G = 1) a group is one head.

Importance, per layer:
  magnitude  the L2 norm of every weight that belongs to the unit: a group's wq / wk / wv rows (and
             biases) and wo columns; a channel's w_gate / w_up rows and w_down column.
  wanda      activation-aware, Wanda's |W_ij| * ||X_j|| summed over the wo (w_down) columns the unit
             feeds, with ||X_j|| the L2 norm of that input feature over calibration tokens: the size of
             the unit's contribution to the residual stream (Wanda-sp, as in FLAP / Wanda's structured
             variant).
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.config.schema import ModelConfig
from lmforge.models.transformer import Transformer


def group_size(cfg: ModelConfig) -> int:
    """Query heads per key/value head."""
    return cfg.n_heads // cfg.resolved_kv_heads


def _rows(units: torch.Tensor, width: int) -> torch.Tensor:
    """The rows (or columns) owned by each of `units` when unit u owns [u * width, (u + 1) * width)."""
    return (units[:, None] * width + torch.arange(width, device=units.device)).flatten()


@torch.no_grad()
def head_scores(model: Transformer, norms: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Importance of every kv group of every layer: (n_layers, n_kv_heads), float32. `norms` (input
    norms of each layer's attn.wo, from `input_norms`) selects the activation-aware score."""
    cfg = model.cfg
    hkv, d, g = cfg.resolved_kv_heads, cfg.resolved_head_dim, group_size(cfg)
    out = []
    for i, block in enumerate(model.layers):
        a = block.attn
        if norms is not None:
            wo = a.wo.weight.float()  # (d_model, H*D)
            per_col = wo.abs().sum(0) * norms[f"layers.{i}.attn.wo.weight"].to(wo.device)  # (H*D,)
            out.append(per_col.view(hkv, g * d).sum(1))
            continue
        sq = a.wq.weight.float().pow(2).view(hkv, g * d, -1).sum((1, 2))  # (Hkv,)
        sq += a.wk.weight.float().pow(2).view(hkv, d, -1).sum((1, 2))
        sq += a.wv.weight.float().pow(2).view(hkv, d, -1).sum((1, 2))
        sq += a.wo.weight.float().pow(2).view(-1, hkv, g * d).sum((0, 2))
        for lin, width in ((a.wq, g * d), (a.wk, d), (a.wv, d)):
            if lin.bias is not None:
                sq += lin.bias.float().pow(2).view(hkv, width).sum(1)
        out.append(sq.sqrt())
    return torch.stack(out)


@torch.no_grad()
def channel_scores(model: Transformer, norms: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Importance of every MLP hidden channel of every layer: (n_layers, d_ff), float32. `norms` (input
    norms of each layer's mlp.w_down) selects the activation-aware score."""
    out = []
    for i, block in enumerate(model.layers):
        m = block.mlp
        down = m.w_down.weight.float()  # (d_model, d_ff)
        if norms is not None:
            out.append(down.abs().sum(0) * norms[f"layers.{i}.mlp.w_down.weight"].to(down.device))
            continue
        sq = down.pow(2).sum(0)
        for lin in (getattr(m, "w_gate", None), m.w_up):
            if lin is None:
                continue
            sq += lin.weight.float().pow(2).sum(1)
            if lin.bias is not None:
                sq += lin.bias.float().pow(2)
        out.append(sq.sqrt())
    return torch.stack(out)


def keep_highest(scores: torch.Tensor, remove: int) -> list[torch.Tensor]:
    """Per row of `scores` (n_layers, n_units): the indices of the units kept when the `remove`
    lowest-scoring ones go, in their original order (ties: the later unit goes)."""
    n = scores.shape[1]
    order = torch.argsort(scores, dim=1, descending=True, stable=True)[:, : n - remove]
    return [row.sort().values for row in order]


@torch.no_grad()
def shrink(
    model: Transformer,
    kv_groups: list[torch.Tensor] | None = None,
    channels: list[torch.Tensor] | None = None,
) -> Transformer:
    """A new, smaller Transformer holding `model`'s weights restricted to the kv groups `kv_groups[i]`
    and MLP channels `channels[i]` of each layer i (index tensors, the same length in every layer; None:
    keep all). Its config has the new n_heads / n_kv_heads / d_ff and an explicit head_dim."""
    cfg = model.cfg
    hkv, d, g, ff = cfg.resolved_kv_heads, cfg.resolved_head_dim, group_size(cfg), cfg.resolved_d_ff
    n_kv = hkv if kv_groups is None else len(kv_groups[0])
    n_ff = ff if channels is None else len(channels[0])
    for keep, total, what in ((kv_groups, hkv, "kv groups"), (channels, ff, "channels")):
        if keep is not None:
            assert len(keep) == cfg.n_layers and all(len(k) == len(keep[0]) for k in keep), what
            assert all(0 < len(k) <= total for k in keep), what
    update = {
        "preset": None,
        "n_heads": n_kv * g,
        "n_kv_heads": None if cfg.n_kv_heads is None else n_kv,
        "head_dim": d,
        "d_ff": n_ff,
    }
    new_cfg = ModelConfig.model_validate({**cfg.model_dump(), **update})
    sd = model.state_dict()
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        if kv_groups is not None:
            groups = kv_groups[i].to(torch.long)
            q_rows, kv_rows = _rows(groups, g * d), _rows(groups, d)  # (n_kv*G*D,), (n_kv*D,)
            for name, rows in (("attn.wq", q_rows), ("attn.wk", kv_rows), ("attn.wv", kv_rows)):
                for kind in ("weight", "bias"):
                    key = f"{p}{name}.{kind}"
                    if key in sd:
                        sd[key] = sd[key][rows.to(sd[key].device)]
            key = f"{p}attn.wo.weight"
            sd[key] = sd[key][:, q_rows.to(sd[key].device)]  # (d_model, n_kv*G*D)
        if channels is not None:
            for name in ("mlp.w_gate", "mlp.w_up"):
                for kind in ("weight", "bias"):
                    key = f"{p}{name}.{kind}"
                    if key in sd:
                        sd[key] = sd[key][channels[i].to(sd[key].device)]
            key = f"{p}mlp.w_down.weight"
            sd[key] = sd[key][:, channels[i].to(sd[key].device)]  # (d_model, n_ff)
    ref = next(model.parameters())
    with torch.device("meta"):
        new = Transformer(new_cfg)
    new.to_empty(device=ref.device)
    new.to(ref.dtype)
    new.load_state_dict(sd, strict=True)  # its post-hook refills the RoPE tables
    new.packed_attention = model.packed_attention
    return new


@torch.no_grad()
def zero_units(
    model: nn.Module,
    kv_groups: list[torch.Tensor] | None = None,
    channels: list[torch.Tensor] | None = None,
) -> None:
    """The masked equivalent of `shrink`, in place on the full model: the wo columns of every kv group
    and the w_down columns of every channel NOT listed are zeroed, so those units contribute nothing
    (removing a unit == zeroing what it writes to the residual stream)."""
    cfg = model.cfg
    hkv, d, g, ff = cfg.resolved_kv_heads, cfg.resolved_head_dim, group_size(cfg), cfg.resolved_d_ff
    for i, block in enumerate(model.layers):
        if kv_groups is not None:
            drop = torch.ones(hkv, dtype=torch.bool)
            drop[kv_groups[i].cpu()] = False
            cols = _rows(torch.nonzero(drop).flatten(), g * d)
            block.attn.wo.weight[:, cols.to(block.attn.wo.weight.device)] = 0
        if channels is not None:
            drop = torch.ones(ff, dtype=torch.bool)
            drop[channels[i].cpu()] = False
            block.mlp.w_down.weight[:, drop.to(block.mlp.w_down.weight.device)] = 0
