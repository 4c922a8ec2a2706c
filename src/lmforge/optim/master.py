"""bf16 weights with fp32 master copies (train.master_weights=fp32), outside FSDP.

The model's matmul weights (nn.Linear weights that no embedding shares) are stored in bf16: exactly
the copies bf16 autocast would make of fp32 weights at every forward, so the forward is the same while
the weight, its gradient and DDP's bucket take 2 bytes instead of 4 and autocast's per-forward copy
disappears. The optimizer keeps an fp32 master of each such weight as optimizer state ("master", so
DCP saves and loads it with the moments under the parameter's name) and around each step:

  pre-hook:  the fp32 master takes the bf16 parameter's place in its param group (with the parameter's
             state and an fp32 copy of its gradient), so the optimizer (any of lmforge's, fused or not)
             creates fp32 moments and updates the master;
  post-hook: parameter and state go back, the master into the state, and the parameter is set to the
             master's bf16 rounding in place.

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
    """Make `optimizer` step fp32 masters of the bf16 weights in `masters` (from `lower_weights`).

    A parameter's dtype never changes (a change would reset its gradient accumulator, and with it the
    hooks DDP hangs on it): for a step, and for loading state, the optimizer's param groups hold the
    fp32 masters in the bf16 parameters' places, and the parameters' state moves with them."""
    lowered = {id(p): p for g in optimizer.param_groups for p in g["params"] if id(p) in masters}
    swapped: list[tuple[dict, int, nn.Parameter, torch.Tensor]] = []  # (group, index, param, master)

    def master_of(opt, p: nn.Parameter) -> torch.Tensor:
        master = opt.state.get(p, {}).get(MASTER)
        if master is None:
            master = masters.get(id(p))
        return master if master is not None else p.detach().float()  # e.g. a weight loaded later

    def swap_in(opt, with_grads: bool) -> None:
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                if id(p) not in lowered or (with_grads and p.grad is None):
                    continue
                master = master_of(opt, p)
                st = opt.state.pop(p, {})
                # Out of the state while stepping: an optimizer creates its moments when a parameter's
                # state is empty (its first step), and the master must not look like one of them.
                st.pop(MASTER, None)
                if st:
                    opt.state[master] = st
                if with_grads:
                    master.grad = p.grad.float()
                group["params"][i] = master
                swapped.append((group, i, p, master))

    def swap_out(opt) -> None:
        for group, i, p, master in swapped:
            group["params"][i] = p
            st = opt.state.pop(master, {})
            master = st.pop(MASTER, master)  # a loaded state brings its own master
            master.grad = None  # a step-time copy; the bf16 gradient is zeroed by the step's caller
            opt.state[p] = {**st, MASTER: master}
            with torch.no_grad():
                p.copy_(master)  # rounds to bf16 in place
            masters.pop(id(p), None)  # the state holds it now (and a resumed run loads it there)
        swapped.clear()

    optimizer.register_step_pre_hook(lambda opt, args, kwargs: swap_in(opt, with_grads=True))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: swap_out(opt))
    # Optimizer.load_state_dict casts each floating state tensor to its parameter's dtype: against the
    # bf16 parameters, a resumed run's masters and moments would come back rounded to bf16.
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: swap_in(opt, with_grads=False))
    optimizer.register_load_state_dict_post_hook(swap_out)


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
