"""bf16 weights with fp32 master copies (train.master_weights=fp32), outside FSDP.

The model's matmul weights (nn.Linear weights that no embedding shares) are stored in bf16: exactly
the copies bf16 autocast would make of fp32 weights at every forward, so the forward is the same while
the weight, its gradient and DDP's bucket take 2 bytes instead of 4 and autocast's per-forward copy
disappears. The optimizer keeps an fp32 master of each such weight as optimizer state ("master", so
DCP saves and loads it with the moments under the parameter's name) and around each step:

  pre-hook:  the parameter's data becomes its fp32 master and its bf16 gradient an fp32 one, so the
             optimizer (any of lmforge's, fused or not) creates fp32 moments and updates the master;
  post-hook: the updated master goes back into state and the parameter is its bf16 rounding again.

Weights that are not matmul weights (norms, embeddings, biases) stay fp32 and are untouched.
"""

from __future__ import annotations

import torch
from torch import nn

MASTER = "master"  # the optimizer-state key of a weight's fp32 master copy


def lowered_params(model: nn.Module) -> list[nn.Parameter]:
    """The weights bf16 storage applies to: trainable fp32 nn.Linear weights no nn.Embedding shares (a
    tied head's weight is also the embedding table, whose lookups would turn the residual stream bf16)."""
    embedded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    seen: set[int] = set()
    out = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            p = m.weight
            if p.requires_grad and p.dtype == torch.float32 and id(p) not in embedded and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def lower_weights(model: nn.Module) -> dict[int, torch.Tensor]:
    """Store `model`'s matmul weights in bf16 (before DDP wraps it, so its buckets are bf16 too);
    returns their fp32 values, the masters' starting point, keyed by id(parameter)."""
    masters = {}
    for p in lowered_params(model):
        masters[id(p)] = p.detach().clone()
        p.data = p.data.to(torch.bfloat16)
    return masters


def keep_masters(optimizer: torch.optim.Optimizer, masters: dict[int, torch.Tensor]) -> None:
    """Make `optimizer` step fp32 masters of the bf16 weights in `masters` (from `lower_weights`)."""
    lowered = [p for g in optimizer.param_groups for p in g["params"] if id(p) in masters]
    swapped: list[tuple[nn.Parameter, torch.Tensor]] = []

    def before(opt, args, kwargs) -> None:
        for p in lowered:
            if p.grad is None:
                continue
            st = opt.state.get(p, {})
            # Out of the state while stepping: an optimizer creates its moments when a parameter's
            # state is empty (its first step), and the master must not look like one of them.
            master = st.pop(MASTER, None)
            if master is None:
                master = masters.get(id(p))
                master = master if master is not None else p.detach().float()  # e.g. DCP's lr=0 warm-up
            grad = p.grad
            p.grad = None
            p.data = master
            p.grad = grad.float()
            swapped.append((p, master))

    def after(opt, args, kwargs) -> None:
        for p, _ in swapped:
            master = p.data
            opt.state[p][MASTER] = master
            p.grad = None  # the fp32 gradient is a step-time copy; zero_grad follows anyway
            p.data = master.to(torch.bfloat16)
            masters.pop(id(p), None)  # the state holds it now (and a resumed run loads it there)
        swapped.clear()

    def before_load(opt, state_dict) -> None:
        # Optimizer.load_state_dict casts each floating state tensor to its parameter's dtype: with
        # bf16 parameters the masters and moments of a resumed run would come back rounded to bf16.
        for p in lowered:
            p.data = p.data.float()

    def after_load(opt) -> None:
        for p in lowered:
            master = opt.state.get(p, {}).get(MASTER)
            p.data = (master if master is not None else p.data).to(torch.bfloat16)
            if master is not None:
                masters.pop(id(p), None)

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
    optimizer.register_load_state_dict_pre_hook(before_load)
    optimizer.register_load_state_dict_post_hook(after_load)


def master_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the fp32 masters the optimizer holds (for measurement)."""
    return sum(st[MASTER].nbytes for st in optimizer.state.values() if MASTER in st)


def start_master_weights(cfg, dims, precision: str, model: nn.Module) -> dict[int, torch.Tensor] | None:
    """Check train.master_weights against the resolved run and, when on, store `model`'s matmul weights
    in bf16 (call before parallelize); returns the masters for `keep_masters`, or None when off."""
    from lmforge.errors import ConfigError

    if cfg.train.master_weights != "fp32":
        return None
    where = "train.master_weights=fp32"
    if precision != "bf16":
        raise ConfigError(f"{where} needs bf16 autocast, but train.precision={cfg.train.precision} resolved "
                          f"to {precision} on this device; set train.precision=bf16, or "
                          f"train.master_weights=off")
    if dims.world_size > 1 and not (dims.ddp and not dims.zero1 and dims.tp == dims.pp == dims.ep == 1):
        raise ConfigError(f"{where} runs in one process or under DDP (parallel.dp_replicate); with FSDP/ZeRO "
                          f"use parallel.param_dtype=bf16 instead (FSDP keeps the fp32 shards as masters), "
                          f"and tensor / pipeline / expert parallelism are not supported with it")
    if cfg.finetune.method != "full":
        raise ConfigError(f"{where} with finetune.method={cfg.finetune.method}: adapters train small fp32 "
                          f"matrices beside a frozen base, with no weights to keep masters of; set "
                          f"train.master_weights=off")
    if cfg.averaging.ema or cfg.averaging.swa:
        raise ConfigError(f"{where} with averaging.ema/swa: the average would follow the bf16 weights, not "
                          f"the fp32 masters; turn the averaging off or set train.master_weights=off")
    masters = lower_weights(model)
    if not masters:
        raise ConfigError(f"{where}: this model has no trainable nn.Linear weights to store in bf16; set "
                          f"train.master_weights=off")
    return masters
