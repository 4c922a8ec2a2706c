"""Muon for the hidden weight matrices, AdamW for everything else, as one optimizer.

Keller Jordan's recipe (https://kellerjordan.github.io/posts/muon/): every nn.Linear weight inside
the transformer blocks (attention wq/wk/wv/wo, MLP w_gate/w_up/w_down) takes Muon's step, the
Newton-Schulz-orthogonalised Nesterov momentum; embeddings, the output head, norms and biases take
AdamW, since orthogonalising a lookup table or a vector has no meaning. One optimizer object keeps
one state_dict, which is what the checkpoint manager and torch.distributed.checkpoint handle.

Both steps are torch's own functional implementations (`torch.optim._muon.muon`,
`torch.optim.adam.adam` with decoupled decay), so each group matches `torch.optim.Muon` or
`torch.optim.AdamW` exactly. The schedule scales every group's own initial lr, so the matrices
follow the same warm-up and decay from muon_lr as the rest does from lr.

torch's Newton-Schulz runs in bf16, which is fast on GPUs and slow on CPUs without bf16 units
(shared cpu-facts: bf16 matmuls ~200x slower there); on such CPUs a Muon step costs several forward-
backward passes of a small model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.optim.adam import adam as adam_functional

from lmforge.errors import ConfigError

# torch.optim.Muon's defaults (Keller Jordan's quintic coefficients and normalisation eps).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def _muon_functional():
    try:
        from torch.optim._muon import muon
    except ImportError:
        raise ConfigError(
            f"optim.name=muon needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}"
        ) from None
    return muon


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The weights of every trainable nn.Linear inside the model's blocks (`model.layers`)."""
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError(
            f"optim.name=muon needs a model whose transformer blocks are `model.layers` (an "
            f"nn.ModuleList); {type(model).__name__} has none: choose another optim.name"
        )
    return [m.weight for m in blocks.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad]


def split_muon_groups(groups: list[dict], hidden: list[nn.Parameter]) -> list[dict]:
    """Split each param group (as `param_groups` makes them) into its hidden matrices, marked
    use_muon=True and named "muon" (from "decay"; "muon_<name>" otherwise), and the rest, which keep
    their name; each part keeps its group's weight decay. Empty parts are dropped."""
    hidden_ids = {id(p) for p in hidden}
    out = []
    for g in groups:
        matrices = [p for p in g["params"] if id(p) in hidden_ids]
        rest = [p for p in g["params"] if id(p) not in hidden_ids]
        name = g["name"]
        if matrices:
            muon_name = "muon" if name == "decay" else f"muon_{name}"
            out.append({**g, "params": matrices, "name": muon_name, "use_muon": True})
        if rest:
            out.append({**g, "params": rest, "use_muon": False})
    return out


class MuonAdamW(torch.optim.Optimizer):
    """Muon on groups with `use_muon=True`, AdamW on the others.

    Muon groups: lr (default muon_lr), weight_decay, momentum, nesterov, ns_steps, ns_coefficients,
    eps (Newton-Schulz), adjust_lr_fn (torch's; None = sqrt(max(1, rows/cols))); state
    `momentum_buffer`. AdamW groups: lr, betas, eps, weight_decay, fused; state `step`, `exp_avg`,
    `exp_avg_sq`.
    """

    def __init__(
        self,
        groups: list[dict],
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        muon_lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        fused: bool | None = None,
    ):
        if lr <= 0.0 or muon_lr <= 0.0:
            raise ValueError(f"lr and muon_lr must be > 0, got lr={lr}, muon_lr={muon_lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {momentum}")
        self._muon_defaults = {
            "lr": muon_lr, "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
            "ns_coefficients": NS_COEFFICIENTS, "eps": NS_EPS, "adjust_lr_fn": None,
        }
        self._adamw_defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "fused": bool(fused)}
        super().__init__(groups, {"weight_decay": 0.0, "use_muon": False})

    def add_param_group(self, param_group: dict) -> None:
        """Fill a group with its kind's defaults (Muon or AdamW) before torch registers it."""
        kind = self._muon_defaults if param_group.get("use_muon", False) else self._adamw_defaults
        for key, value in kind.items():
            param_group.setdefault(key, value)
        if param_group.get("use_muon", False):
            for p in param_group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon groups take 2-D matrices only, got a {tuple(p.shape)} parameter")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["use_muon"]:
                self._muon_step(group, params)
            else:
                self._adamw_step(group, params)
        return loss

    def _muon_step(self, group: dict, params: list[torch.Tensor]) -> None:
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        _muon_functional()(
            params, [p.grad for p in params], bufs, lr=group["lr"], weight_decay=group["weight_decay"],
            momentum=group["momentum"], nesterov=group["nesterov"], ns_coefficients=group["ns_coefficients"],
            eps=group["eps"], ns_steps=group["ns_steps"], adjust_lr_fn=group["adjust_lr_fn"],
            has_complex=False,
        )

    def _adamw_step(self, group: dict, params: list[torch.Tensor]) -> None:
        fused = group["fused"]
        for p in params:
            state = self.state[p]
            if not state:
                # Where torch.optim.AdamW keeps its step counter: on the device for the fused kernel.
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                                 else torch.tensor(0.0))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam_functional(
            params, [p.grad for p in params], [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
            fused=fused or None, decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )
