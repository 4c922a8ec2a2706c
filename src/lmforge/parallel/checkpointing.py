"""Activation checkpointing applied from outside the model, per transformer block.

Wrapping with torch's `checkpoint_wrapper` keeps state_dict keys unchanged (it strips its own
prefix), so checkpoints do not depend on whether recomputation was on.

Modes: "full" recomputes every block in backward, "every_k" blocks 0, k, 2k, ... whole, "selective"
every block but only its cheap ops (torchtitan's per-op policy): the outputs of matmuls, attention
kernels, collectives and the MoE router's top-k are kept from the forward, so the backward re-runs norms,
activations, rotary embeddings and residual adds but no matmul (with `save="alternate_matmuls"`, every
second matmul as torchtitan does).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lmforge.models.transformer import Block

MODES = ("none", "full", "every_k", "selective")
# torchtitan's selective policy keeps every second matmul only. Here that is an option, not the default:
# "selective" is meant as the cheap point between none and full, and keeping all matmuls is what makes
# it cheap. Measured on a CPU (fp32, d 512, 2 x 512 tokens, forward + backward time against none, 4
# layers; activations kept for backward against none, 8 layers x 4 x 512): all_matmuls 1.04x the time
# with 0.53x the activations, alternate_matmuls 1.08x with 0.36x, full 1.22x with 0.14x. Alternate is
# for when the memory matters more than those 4%.
SAVES = ("all_matmuls", "alternate_matmuls")

# Projection-style matmuls: the ops "alternate_matmuls" counts. linear is a leaf op only on backends that
# do not decompose it into (add)mm; grouped mm is the MoE experts' GEMM on CUDA.
_MATMULS = ("mm", "addmm", "linear", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm")
# Always kept: batched matmuls (attention's scores and values on the math path, O(T^2) to redo), every
# fused attention kernel of this torch (their outputs include the logsumexp the backward needs), top-k
# (on a GPU, ties may route a token differently in the recompute: keep the MoE routing the forward used)
# and the collectives torchtitan keeps (reduce-scatter, all-to-all), which the recompute would issue again.
_KEPT = (
    ("aten", "bmm"), ("aten", "baddbmm"), ("aten", "topk"),
    ("aten", "_scaled_dot_product_flash_attention"), ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
    ("aten", "_scaled_dot_product_efficient_attention"), ("aten", "_scaled_dot_product_cudnn_attention"),
    ("aten", "_scaled_dot_product_fused_attention_overrideable"), ("aten", "_flash_attention_forward"),
    ("aten", "_efficient_attention_forward"), ("aten", "_cudnn_attention_forward"),
    ("_c10d_functional", "reduce_scatter_tensor"), ("_c10d_functional", "all_to_all_single"),
)


def _overloads(namespace: str, names) -> frozenset:
    """The .default overloads of the ops this torch has (builds without CUDA still register most)."""
    ns = getattr(torch.ops, namespace)
    return frozenset(getattr(ns, n).default for n in names if hasattr(ns, n))


@cache
def _op_sets() -> tuple[frozenset, frozenset]:
    """(matmuls, other kept ops) of this torch. Flex attention, and regions compiled inside an eager
    block (the packed-rows flex kernel on CUDA), reach the policy as higher-order ops."""
    import torch._higher_order_ops as hop

    names = ("flex_attention", "inductor_compiled_code")
    higher = frozenset(getattr(hop, n) for n in names if hasattr(hop, n))
    return _overloads("aten", _MATMULS), frozenset().union(*(_overloads(ns, [n]) for ns, n in _KEPT), higher)


def selective_policy(save: str = "all_matmuls", dead_rhs: tuple[int, int] | None = None) -> Callable:
    """A fresh per-forward policy for `create_selective_checkpoint_contexts`: MUST_SAVE the outputs of
    matmuls (every second one with "alternate_matmuls"), attention kernels, top-k, device-to-host copies
    and the kept collectives; PREFER_RECOMPUTE everything else. A matmul whose right operand has shape
    `dead_rhs` (in, out) is never kept (see `_dead_matmul`)."""
    if save not in SAVES:
        raise ValueError(f"save must be one of {SAVES}, got {save!r}")
    matmuls, kept = _op_sets()
    to_copy = torch.ops.aten._to_copy.default
    # Matmuls seen so far, counted apart for the forward and the recompute: torch before 2.13 asks the
    # policy again in the recompute, and both passes must then make the same choices.
    seen = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in matmuls:
            if dead_rhs is not None and _rhs_shape(func, args) == dead_rhs:
                return CheckpointPolicy.PREFER_RECOMPUTE
            seen[ctx.is_recompute] += 1
            # torchtitan's rule: the odd-numbered matmuls of a block are kept, the even ones redone.
            if save == "alternate_matmuls" and seen[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        if func in kept:
            return CheckpointPolicy.MUST_SAVE
        # A GPU -> CPU copy (the MoE's per-expert counts for the split) is a host sync: keep its result.
        device = kwargs.get("device") if func is to_copy else None
        if device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu":
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _rhs_shape(func, args) -> tuple[int, ...]:
    """(in, out) of a matmul's weight-side operand: mm(x, w.t()), addmm(b, x, w.t()), linear(x, w)."""
    if func is torch.ops.aten.addmm.default:
        return tuple(args[2].shape)
    if func is torch.ops.aten.linear.default:
        return tuple(args[1].shape)[::-1]
    return tuple(args[1].shape) if len(args) > 1 and isinstance(args[1], torch.Tensor) else ()


def _dead_matmul(block: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a pre-norm dense block's last projection, mlp.w_down, when nothing but the residual
    add reads its output (no dropout after it): keeping that output would be pure waste, since the
    non-reentrant recompute stops as soon as the tensors the backward needs are rebuilt, which is before
    w_down runs again (measured: the kept entry was never read). None for other blocks (a post-norm
    block's norm saves the sum, which needs w_down's output again) and where the weight's shape is not
    unique in the block (d_ff == d_model, say): the shape is how the policy recognises it."""
    w_down = getattr(getattr(block, "mlp", None), "w_down", None)
    weight = getattr(w_down, "weight", None)
    if not isinstance(block, Block) or not isinstance(block.drop, nn.Identity) or \
            not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    shapes = [tuple(p.shape) for n, p in block.named_parameters() if n.endswith("weight") and p.dim() == 2]
    if shapes.count(tuple(weight.shape)) != 1:
        return None
    return tuple(weight.shape)[::-1]


def _selective_context(save: str, dead_rhs: tuple[int, int] | None):
    return create_selective_checkpoint_contexts(selective_policy(save, dead_rhs))


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2,
                                   save: str = "all_matmuls") -> int:
    """Recompute activations of blocks in `model.layers` during backward.

    mode: "none", "full" (every block), "every_k" (blocks 0, k, 2k, ...) or "selective" (every block,
    keeping the outputs of the expensive ops; `save` picks all matmuls or every second one). Returns how
    many blocks were wrapped. `model.layers` is a ModuleList, or a pipeline stage's ModuleDict keyed by
    global layer index (so every_k picks the same blocks however the model is split).
    """
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return 0
    # preserve_rng_state: dropout draws the same masks in the recompute as in the forward.
    kwargs: dict = dict(checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True)
    if save not in SAVES:
        raise ValueError(f"save must be one of {SAVES}, got {save!r}")
    wrapped = 0
    for name, block in list(model.layers.named_children()):
        if mode == "every_k" and int(name) % every != 0:
            continue
        kw = dict(kwargs)
        if mode == "selective":
            # a context per forward: the storage of kept outputs and the policy's matmul count are per call
            kw["context_fn"] = partial(_selective_context, save, _dead_matmul(block))
        model.layers.register_module(name, checkpoint_wrapper(block, **kw))
        wrapped += 1
    return wrapped
