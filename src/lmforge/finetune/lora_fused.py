"""The fused autograd functions behind `LoRALinear` (finetune/lora.py): a frozen base linear layer
and its LoRA adapter computed as one function, alone (`LoRALinearFn`) or as a group of layers that
read the same input (`LoRAGroupFn`: attention's q/k/v, SwiGLU's gate/up).

Both compute PEFT's y = x W^T + b + s (x A^T) B^T, only with fewer passes over memory: the adapter's
low-rank product is added into the base GEMM's output in place, and nothing is kept for the
backward but x, W and x A^T. LoRALinear decides when they apply (`_fusable`, `project_group`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(x, weight) computes in: autocast's where it is on, else the activations'."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return torch.promote_types(x.dtype, weight.dtype)


class LoRALinearFn(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T for a frozen W, in the dtype of x (the caller casts x, W and b
    to it; A and B, the trainable float32 masters, are cast here, as autocast would cast them).

    Against base(x) + lora(x) as separate modules (PEFT's graph): the adapter path adds its low-rank
    product into the base GEMM's output in place (addmm_ with beta=1) instead of materialising a
    (tokens, out) adapter output and adding it, and the backward adds the adapter's share of the input
    gradient into g W the same way: no (tokens, out) or (tokens, in) tensor beyond the one returned
    (on the CPU each fresh one costs page faults and a copy). Nothing is kept for the backward but
    x, W and the (tokens, r) x A^T.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, in)
        a, b = lora_a.to(x.dtype), lora_b.to(x.dtype)  # (r, in), (out, r)
        u = torch.mm(x2, a.t()).mul_(scaling)  # (N, r): s x A^T
        y = F.linear(x2, weight, bias).addmm_(u, b.t())  # (N, out)
        ctx.save_for_backward(x2, weight, a, b, u)
        ctx.scaling, ctx.shape = scaling, shape
        ctx.dtypes = (lora_a.dtype, lora_b.dtype)
        return y.view(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x2, weight, a, b, u = ctx.saved_tensors
        g = grad_y.reshape(-1, weight.shape[0])  # (N, out)
        grad_x = grad_a = grad_b = None
        gb = torch.mm(g, b).mul_(ctx.scaling)  # (N, r): s g B
        if ctx.needs_input_grad[3]:
            grad_a = torch.mm(gb.t(), x2).to(ctx.dtypes[0])  # (r, in)
        if ctx.needs_input_grad[4]:
            grad_b = torch.mm(g.t(), u).to(ctx.dtypes[1])  # (out, r)
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(g, weight).addmm_(gb, a).view(ctx.shape)  # g W + s g B A
        return grad_x, None, None, grad_a, grad_b, None


class LoRAGroupFn(torch.autograd.Function):
    """y_i = x W_i^T + b_i + s_i (x A_i^T) B_i^T for k frozen W_i sharing the input x (attention's
    q/k/v, SwiGLU's gate/up): `LoRALinearFn` for each, with the A's stacked into one (sum r, in)
    matrix. Against k separate functions: one pass over x for x A^T (forward) and for the A
    gradients (backward) instead of k, and the input gradient is one (tokens, in) buffer that every
    g_i W_i and the stacked s g B A are added into (no k partial gradients for autograd to sum).
    apply(x, weights, biases, scalings, A_1, B_1, ..., A_k, B_k): the adapters are flat arguments so
    that autograd sees them as inputs.
    """

    @staticmethod
    def forward(ctx, x, weights, biases, scalings, *adapters):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (N, in)
        a_list = [a.to(x.dtype) for a in adapters[0::2]]  # (r_i, in)
        b_list = [b.to(x.dtype) for b in adapters[1::2]]  # (out_i, r_i)
        a = torch.cat(a_list)  # (R, in), R = sum r_i
        u = torch.mm(x2, a.t())  # (N, R): x A_i^T side by side
        bounds = _bounds([t.shape[0] for t in a_list])
        ys = []
        for (lo, hi), w, bias, b, s in zip(bounds, weights, biases, b_list, scalings):
            ui = u[:, lo:hi].mul_(s)  # s_i x A_i^T, in place in its columns of u
            ys.append(F.linear(x2, w, bias).addmm_(ui, b.t()).view(*shape[:-1], w.shape[0]))
        ctx.save_for_backward(x2, a, u, *weights, *b_list)
        ctx.k, ctx.shape, ctx.bounds, ctx.scalings = len(weights), shape, bounds, scalings
        ctx.dtypes = [t.dtype for t in adapters]
        return tuple(ys)

    @staticmethod
    def backward(ctx, *grads):
        x2, a, u, *rest = ctx.saved_tensors
        k = ctx.k
        weights, b_list = rest[:k], rest[k:]
        n = x2.shape[0]
        gs = [g.reshape(n, w.shape[0]) for g, w in zip(grads, weights)]  # (N, out_i)
        # s_i g_i B_i side by side: (N, R). (N, r) products are faster than (r, N) ones (MKL, measured).
        gb = torch.cat([torch.mm(g, b).mul_(s) for g, b, s in zip(gs, b_list, ctx.scalings)], dim=1)
        grad_adapters: list[torch.Tensor | None] = [None] * (2 * k)
        needs = ctx.needs_input_grad[4:]
        if any(needs[0::2]):
            grad_a = torch.mm(gb.t(), x2)  # (R, in): every A gradient in one pass over x
            for i, (lo, hi) in enumerate(ctx.bounds):
                if needs[2 * i]:
                    grad_adapters[2 * i] = grad_a[lo:hi].to(ctx.dtypes[2 * i])
        for i, ((lo, hi), g) in enumerate(zip(ctx.bounds, gs)):
            if needs[2 * i + 1]:
                grad_adapters[2 * i + 1] = torch.mm(g.t(), u[:, lo:hi]).to(ctx.dtypes[2 * i + 1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(gs[0], weights[0])  # (N, in)
            for g, w in zip(gs[1:], weights[1:]):
                grad_x.addmm_(g, w)
            grad_x = grad_x.addmm_(gb, a).view(ctx.shape)  # + sum_i s_i g_i B_i A_i
        return grad_x, None, None, None, *grad_adapters


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[(0, s0), (s0, s0 + s1), ...]: the row range of each part of a concatenation."""
    out, lo = [], 0
    for size in sizes:
        out.append((lo, lo + size))
        lo += size
    return out
