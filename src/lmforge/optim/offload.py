"""train.optimizer_offload=cpu: the optimizer's state and its update live in host memory, outside FSDP
(DeepSpeed's offload_optimizer for one GPU or DDP; FSDP has parallel.cpu_offload).

Each trained parameter has a host copy (pinned on CUDA). Around each optimizer step:

  pre-hook:  the host copy takes the parameter's place in its param group, with the parameter's state
             and a host copy of its (final: clipped, all-reduced) gradient; the host copy is first
             refreshed from the parameter, so whatever changed the weights since the last step
             (loading a checkpoint, a rollback) is what the update starts from;
  step:      the optimizer (any of lmforge's; torch's fused CPU kernels where configured) updates the
             host copy and creates / updates its moments there;
  post-hook: parameter and state go back (the state stays in host memory, keyed by the parameter, so a
             checkpoint has the same layout with or without offload), and the parameter takes the new
             value (host -> device).

Traffic per step is the weights down, the gradients down and the weights up (12 bytes per fp32
parameter), synchronous: it trades step time for device memory (the optimizer state, 8 bytes per
parameter for AdamW, leaves the device). On a CPU the "device" tensors are host tensors too, but the
copies are distinct tensors and the path is the same, which is what the CPU tests check.
"""

from __future__ import annotations

import torch
from torch import nn


def keep_offloaded(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Make `optimizer` keep its state and run its step in host memory (see the module docstring)."""
    pin = device.type == "cuda"
    host: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, int, nn.Parameter, torch.Tensor]] = []

    def host_copy(p: nn.Parameter) -> torch.Tensor:
        h = host.get(id(p))
        if h is None:
            h = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            host[id(p)] = h
        return h

    def swap_in(opt, stepping: bool) -> None:
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                if stepping and p.grad is None:
                    continue
                h = host_copy(p)
                if stepping:
                    h.copy_(p.detach(), non_blocking=pin)
                    if h.grad is None:
                        h.grad = torch.empty(p.shape, dtype=p.grad.dtype, device="cpu", pin_memory=pin)
                    h.grad.copy_(p.grad, non_blocking=pin)
                st = opt.state.pop(p, None)
                if st:
                    opt.state[h] = st
                group["params"][i] = h
                swapped.append((group, i, p, h))
        if stepping and pin:
            torch.cuda.current_stream(device).synchronize()  # the copies have landed
        found = getattr(opt, "found_inf", None)  # apply_update's device-side skip flag (fused kernels)
        if stepping and found is not None:
            opt.found_inf = found.to("cpu")

    def swap_out(opt, stepped: bool) -> None:
        for group, i, p, h in swapped:
            group["params"][i] = p
            st = opt.state.pop(h, None)
            if st:
                opt.state[p] = st
            if stepped:
                with torch.no_grad():
                    p.copy_(h, non_blocking=pin)
        swapped.clear()

    optimizer.register_step_pre_hook(lambda opt, args, kwargs: swap_in(opt, stepping=True))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: swap_out(opt, stepped=True))
    # Optimizer.load_state_dict casts each state tensor to its parameter's device: against the host
    # copies, a resumed run's moments load into host memory (and a checkpoint written without offload
    # loads too, moved to the host).
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: swap_in(opt, stepping=False))
    optimizer.register_load_state_dict_post_hook(lambda opt: swap_out(opt, stepped=False))


def start_optimizer_offload(cfg, dims, device: torch.device, optimizer: torch.optim.Optimizer) -> None:
    """Check train.optimizer_offload against the run's layout and, when on, install it on `optimizer`."""
    from lmforge.errors import ConfigError

    if cfg.train.optimizer_offload == "none":
        return
    where = "train.optimizer_offload=cpu"
    if dims.fsdp:
        raise ConfigError(f"{where} with FSDP: use parallel.cpu_offload=true, which offloads the FSDP shards "
                          "and their optimizer state")
    if dims.zero1 or dims.tp > 1 or dims.pp > 1 or dims.ep > 1:
        raise ConfigError(f"{where} runs in one process or under DDP (parallel.dp_replicate); ZeRO-1, "
                          "tensor, pipeline and expert parallelism are not supported with it")
    if cfg.train.master_weights != "off":
        raise ConfigError(f"{where} with train.master_weights={cfg.train.master_weights}: the two rearrange "
                          "the optimizer's parameters each their own way; set one of them")
    keep_offloaded(optimizer, device)
