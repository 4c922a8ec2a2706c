"""Optimizer construction: parameter groups with and without weight decay."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.config.schema import OptimConfig
from lmforge.optim.adafactor import Adafactor
from lmforge.optim.adamw8bit import AdamW8bit, bitsandbytes_adamw8bit, use_bitsandbytes
from lmforge.optim.lion import Lion
from lmforge.optim.muon import MuonAdamW, hidden_matrices, split_muon_groups
from lmforge.optim.sophia import Sophia


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters into a decayed group (matrices of linear layers) and an undecayed one.

    Norm weights, biases and embedding tables are not decayed: decay there only shrinks scales
    and lookup rows without regularising a linear map (the GPT-3 / Llama recipe).
    """
    embedding_params = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)
    }
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or id(p) in embedding_params:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    return groups


def _fused(model: nn.Module, cfg: OptimConfig) -> bool:
    if cfg.fused is not None:
        return cfg.fused
    return next(model.parameters()).device.type in ("cpu", "cuda")


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` over `param_groups` (weight decay per group).

    adamw/adam use the fused kernel where the parameters' device supports it: on CPU it is several
    times faster than the for-loop path and matches it to float rounding (see shared cpu-facts).
    """
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=_fused(model, cfg)
        )
    if cfg.name == "adam":
        return torch.optim.Adam(
            groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=_fused(model, cfg)
        )
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    if cfg.name == "lion":
        return Lion(groups, lr=cfg.lr, betas=tuple(cfg.betas))
    if cfg.name == "adafactor":
        return Adafactor(
            groups,
            lr=None if cfg.relative_step else cfg.lr,
            eps=tuple(cfg.adafactor_eps),
            clip_threshold=cfg.clip_threshold,
            decay_rate=cfg.decay_rate,
            beta1=cfg.adafactor_beta1,
            scale_parameter=cfg.scale_parameter,
            relative_step=cfg.relative_step,
            warmup_init=cfg.warmup_init,
        )
    if cfg.name == "adamw8bit":
        device = next(model.parameters()).device
        if use_bitsandbytes(cfg.quant_backend, device, cfg.quant_block_size):
            return bitsandbytes_adamw8bit(groups, cfg.lr, tuple(cfg.betas), cfg.eps, cfg.quant_block_size,
                                          cfg.quant_min_size)
        return AdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                         block_size=cfg.quant_block_size, min_quant_size=cfg.quant_min_size)
    if cfg.name == "sophia":
        return Sophia(groups, lr=cfg.lr, betas=tuple(cfg.betas), rho=cfg.sophia_rho, eps=cfg.eps,
                      hessian_every=cfg.hessian_every, estimator=cfg.hessian_estimator)
    if cfg.name == "muon":
        return MuonAdamW(split_muon_groups(groups, hidden_matrices(model)), lr=cfg.lr, betas=tuple(cfg.betas),
                         eps=cfg.eps, muon_lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                         nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps, fused=_fused(model, cfg))
    raise ValueError(f"unknown optimizer {cfg.name!r}")


def state_bytes_per_param(optimizer: torch.optim.Optimizer) -> float:
    """Bytes of optimizer state (every tensor in `optimizer.state`, step counters included) per
    trainable parameter element. Textbook fp32 figures: sgd 0, sgd+momentum 4, adam(w) 8, lion 4,
    adafactor (factored, no beta1) well under 1."""
    n_params = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    n_bytes = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                n_bytes += v.numel() * v.element_size()
    return n_bytes / max(n_params, 1)
