"""Unstructured and 2:4 semi-structured pruning of a Transformer's linear weights, the statistics they
are judged by (weight magnitude, or Wanda's |W| * ||X|| with calibration activations), the sparsity
counted back from the weights, and `KeepSparsity`, the training callback that keeps the zeros zero
during a recovery fine-tune.

A mask is a boolean tensor shaped like its weight, True = kept. Masks are never stored: the pruned
weights are the record (a weight that is exactly 0 is pruned), so a checkpoint holds everything and
a resumed run derives the same masks again.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmforge.errors import LmforgeError
from lmforge.train.callbacks import Callback

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer

# The blocks' linear weights: what pruning touches unless the output head is asked for as well.
_BLOCK_WEIGHT = re.compile(r"(?:^|\.)layers\.\d+\.(?:attn\.w[qkvo]|mlp\.w_(?:gate|up|down))\.weight$")
# Wrappers a training run may put around the model (compile, DDP, activation checkpointing) add these
# segments to parameter names; the checkpoint names (and ours) are without them.
_WRAPPER_SEGMENTS = ("_orig_mod.", "module.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter name without the segments wrappers add ("_orig_mod.layers.0..." -> "layers.0...")."""
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def head_weight_name(model: nn.Module) -> str:
    """The output projection's weight: `output.weight`, or the embedding table when they are tied."""
    return "tok_embeddings.weight" if model.cfg.tie_embeddings else "output.weight"


def prunable_weights(model: nn.Module, include_head: bool = False) -> dict[str, nn.Parameter]:
    """The weights pruning acts on, by parameter name: every block's attention and MLP projections
    (each (out_features, in_features)); with `include_head` also the output projection (the embedding
    table when tied: then input embeddings lose the same entries)."""
    head = head_weight_name(model) if include_head else None
    return {
        name: p for name, p in model.named_parameters()
        if _BLOCK_WEIGHT.search(name) or name == head
    }


# -- calibration statistics --------------------------------------------------------------------------
@torch.no_grad()
def input_norms(
    model: nn.Module, batches: Iterable[torch.Tensor], names: Iterable[str]
) -> dict[str, torch.Tensor]:
    """L2 norm over every calibration token of each input feature of the weights `names` (parameter
    names from `prunable_weights`): {name: (in_features,)} in float32. Wanda's ||X_j||.

    `batches` are token id tensors (B, T). One pass through the dense model: every layer sees the
    unpruned model's activations (Wanda prunes layer by layer on the pruned model's; one pass is
    cheaper and the masks of one layer do not depend on the order the others are pruned in)."""
    names = list(names)
    sums: dict[str, torch.Tensor] = {}
    hooks = []

    def add(name: str, x: torch.Tensor) -> None:
        sq = x.detach().float().pow(2).reshape(-1, x.shape[-1]).sum(0)  # (in,)
        sums[name] = sums[name] + sq if name in sums else sq

    for name in names:
        if name in ("tok_embeddings.weight", "output.weight"):
            # The head's input is the final norm's output (with tied embeddings there is no module).
            hooks.append(model.norm.register_forward_hook(lambda m, a, out, n=name: add(n, out)))
            continue
        module = model.get_submodule(name.removesuffix(".weight"))
        hooks.append(module.register_forward_pre_hook(lambda m, args, n=name: add(n, args[0])))
    was = model.training
    model.eval()
    try:
        for ids in batches:
            model(ids.to(next(model.parameters()).device))
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    if set(sums) != set(names):
        raise LmforgeError("no calibration tokens reached the model; give calibration text (--calib)")
    return {n: sums[n].sqrt() for n in names}


def scores_of(
    weights: dict[str, torch.Tensor], norms: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """What pruning ranks: |W| (magnitude) or, with input norms, Wanda's |W_ij| * ||X_j||; float32."""
    out = {}
    for name, w in weights.items():
        s = w.detach().float().abs()  # (out, in)
        out[name] = s if norms is None else s * norms[name].to(s.device)[None, :]
    return out


# -- masks -------------------------------------------------------------------------------------------
def _lowest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k lowest entries of a flat tensor; ties broken by position (stable sort)."""
    return torch.argsort(scores, stable=True)[:k]


def unstructured_masks(
    scores: dict[str, torch.Tensor], sparsity: float, scope: str = "layer"
) -> dict[str, torch.Tensor]:
    """Masks removing the `sparsity` fraction of lowest-scoring entries: of each weight (scope "layer"),
    or of all of them ranked together (scope "global"). The count removed is round(sparsity * n), as
    torch.nn.utils.prune counts it."""
    if not 0.0 <= sparsity < 1.0:
        raise LmforgeError(f"sparsity must lie in [0, 1), got {sparsity}")
    if scope not in ("layer", "global"):
        raise LmforgeError(f"scope must be layer or global, got {scope!r}")
    masks = {}
    if scope == "layer":
        for name, s in scores.items():
            flat = torch.ones(s.numel(), dtype=torch.bool, device=s.device)
            flat[_lowest(s.flatten(), round(sparsity * s.numel()))] = False
            masks[name] = flat.view_as(s)
        return masks
    flat_scores = torch.cat([s.flatten() for s in scores.values()])
    keep = torch.ones(flat_scores.numel(), dtype=torch.bool, device=flat_scores.device)
    keep[_lowest(flat_scores, round(sparsity * flat_scores.numel()))] = False
    start = 0
    for name, s in scores.items():
        masks[name] = keep[start:start + s.numel()].view_as(s)
        start += s.numel()
    return masks


def semi_structured_masks(scores: dict[str, torch.Tensor], n: int = 2, m: int = 4) -> dict[str, torch.Tensor]:
    """n:m masks (default 2:4): in every aligned group of m consecutive entries of a row, i.e. along the
    input dimension of an (out, in) weight, the n highest-scoring are kept. This is the layout of
    torch's `to_sparse_semi_structured` and torchao's 2:4 sparsifier (block shape (1, 4)), which the
    sparse tensor cores need."""
    masks = {}
    for name, s in scores.items():
        rows, cols = s.shape
        if cols % m:
            raise LmforgeError(f"{name}: {cols} input features are not a multiple of {m}; {n}:{m} sparsity "
                               f"needs groups of {m} along the input dimension")
        groups = s.reshape(rows, cols // m, m)  # (out, in/m, m)
        keep = torch.zeros_like(groups, dtype=torch.bool)
        keep.scatter_(-1, groups.topk(n, dim=-1).indices, True)
        masks[name] = keep.view(rows, cols)
    return masks


@torch.no_grad()
def apply_masks(weights: dict[str, torch.Tensor], masks: dict[str, torch.Tensor]) -> None:
    """Zero the pruned entries in place."""
    for name, mask in masks.items():
        weights[name].mul_(mask.to(weights[name].dtype))


# -- sparsity counted from the weights ---------------------------------------------------------------
@torch.no_grad()
def sparsity_stats(model: nn.Module, include_head: bool = False) -> dict:
    """Zeros counted in the weights: per prunable weight (fraction), over the prunable weights
    together, and over every parameter of the model."""
    per_layer, zeros, total = {}, 0, 0
    for name, p in prunable_weights(model, include_head).items():
        z = int((p == 0).sum())
        per_layer[name] = z / p.numel()
        zeros, total = zeros + z, total + p.numel()
    all_zeros = sum(int((p == 0).sum()) for p in model.parameters())
    all_params = sum(p.numel() for p in model.parameters())
    return {
        "overall": zeros / total if total else 0.0,
        "zeros": zeros,
        "prunable_params": total,
        "of_all_params": all_zeros / all_params,
        "per_layer": per_layer,
    }


def semi_structured_ok(w: torch.Tensor, n: int = 2, m: int = 4) -> bool:
    """Whether every aligned group of m consecutive entries along each row has at most n non-zeros."""
    rows, cols = w.shape
    return cols % m == 0 and bool(((w.reshape(rows, cols // m, m) != 0).sum(-1) <= n).all())


# -- keeping the zeros during training --------------------------------------------------------------
class KeepSparsity(Callback):
    """Keeps pruned weights exactly zero while a sparse model trains (the recovery fine-tune).

    At the start of training (a resumed run included) each prunable weight's mask is read from the
    weights themselves: the entries that are exactly 0. Gradients are masked on their way into the
    optimizer (the sparse model's true gradient: with W = M * V, dL/dV = M * dL/dW), so momentum, Adam's
    moments and the gradient-norm clip see the kept weights only, and after every optimizer step the
    pruned entries are set to 0 again (optimizer state carried over from elsewhere, or an update rule
    that moves zero-gradient weights, cannot leave them non-zero).

    `names`: the parameters to keep sparse (names as in the checkpoint); default every block weight
    that holds a zero (plus the output head with `include_head`).
    """

    def __init__(self, names: Iterable[str] | None = None, include_head: bool = False) -> None:
        self.names = None if names is None else set(names)
        self.include_head = include_head
        self.masks: dict[str, tuple[nn.Parameter, torch.Tensor]] = {}
        self._hooks: list = []

    @torch.no_grad()
    def attach(self, model: nn.Module) -> None:
        """Read the masks from `model`'s weights and mask its gradients (what on_train_start does)."""
        self.detach()
        inner = _unwrapped(model)
        head = head_weight_name(inner) if self.include_head and hasattr(inner, "cfg") else None
        for raw, p in model.named_parameters():
            name = canonical_name(raw)
            wanted = name in self.names if self.names is not None else bool(_BLOCK_WEIGHT.search(name))
            if not (wanted or name == head):
                continue
            mask = p != 0
            if bool(mask.all()):
                continue  # nothing pruned here
            self.masks[name] = (p, mask)
            if p.requires_grad:
                self._hooks.append(p.register_hook(lambda g, m=mask: g * m.to(g.dtype)))

    @torch.no_grad()
    def reapply(self) -> None:
        """Set every pruned entry to 0 again."""
        for p, mask in self.masks.values():
            p.mul_(mask.to(p.dtype))

    def detach(self) -> None:
        """Stop masking gradients (the masks are forgotten)."""
        for h in self._hooks:
            h.remove()
        self._hooks, self.masks = [], {}

    def on_train_start(self, trainer: Trainer) -> None:
        self.attach(trainer.model)

    def on_step_end(self, trainer: Trainer, step: int, result) -> None:
        self.reapply()

    def on_train_end(self, trainer: Trainer, metrics) -> None:
        self.detach()


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module under torch.compile / DDP wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
