"""Linear + cross-entropy fused over token chunks: the (N, V) logits never exist whole.

The gradients with respect to the hidden states and the output projection are computed during the
forward, one chunk of rows at a time (the approach of Liger-Kernel's fused linear cross entropy), so
peak extra memory is O(chunk_tokens x V) instead of the O(N x V) logits, log-probabilities and their
gradient that F.linear + F.cross_entropy keep for backward.
"""

from __future__ import annotations

import torch

__all__ = ["chunked_linear_cross_entropy"]


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(hidden, weight) would run its matmul in (autocast's, if it is on)."""
    device_type = hidden.device.type
    # autocast leaves float64 alone
    if torch.is_autocast_enabled(device_type) and torch.float64 not in (hidden.dtype, weight.dtype):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _fused_forward(
    hidden: torch.Tensor,  # (N, d)
    weight: torch.Tensor,  # (V, d)
    targets: torch.Tensor,  # (N,)
    chunk_tokens: int,
    ignore_index: int,
    dtype: torch.dtype,
    need_hidden_grad: bool,
    need_weight_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Summed fp32 loss, and d loss / d hidden and d loss / d weight where asked for."""
    n = hidden.size(0)
    w = weight.to(dtype)  # (V, d); one cast for all chunks, as autocast caches it for F.linear
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty_like(hidden) if need_hidden_grad else None  # (N, d)
    # fp32 accumulator: summing N/C partial products in bf16/fp16 would round at every chunk
    grad_w = None
    if need_weight_grad:
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # (V, d)
    for start in range(0, n, chunk_tokens):
        end = min(start + chunk_tokens, n)
        h = hidden[start:end].to(dtype)  # (C, d)
        t = targets[start:end]  # (C,)
        valid = t != ignore_index  # (C,)
        t_safe = torch.where(valid, t, 0).unsqueeze(1)  # (C, 1); ignored rows gather a real column
        logits = torch.mm(h, w.t()).float()  # (C, V): fp32 whatever the matmul ran in
        if grad_h is None and grad_w is None:
            # log_softmax: the kernel F.cross_entropy runs, so the only difference from it in fp32 is
            # the matmuls' blocking
            picked = torch.log_softmax(logits, dim=1).gather(1, t_safe).squeeze(1)
            loss = loss - torch.where(valid, picked, 0.0).sum()
            continue
        # d loss_i / d logits_i = softmax_i - one_hot(t_i). One softmax pass gives the loss too: the
        # largest probability of a row is exp(0) / S at its largest logit m, so log S = -log(max p)
        # (that probability is >= 1 / V: no underflow) and -log p_t = m + log S - logit_t.
        g = torch.softmax(logits, dim=1)  # (C, V)
        log_sum = logits.amax(dim=1) - g.amax(dim=1).log()  # (C,): m + log S
        picked = logits.gather(1, t_safe).squeeze(1)  # (C,)
        loss = loss + torch.where(valid, log_sum - picked, 0.0).sum()
        g.scatter_add_(1, t_safe, torch.full_like(t_safe, -1.0, dtype=g.dtype))
        # zero the ignored rows (a fill, not a multiply: they may hold inf or nan); in eager only those
        # rows are touched, when there are any (compiled, the masked fill fuses into the softmax)
        if torch.compiler.is_compiling():
            g.masked_fill_(~valid.unsqueeze(1), 0.0)
        elif not bool(valid.all()):
            g.index_fill_(0, torch.nonzero(~valid).squeeze(1), 0.0)
        g = g.to(dtype)  # (C, V); the backward matmuls run in the forward's dtype, as autocast's would
        if grad_h is not None:
            torch.mm(g, w, out=grad_h[start:end]) if grad_h.dtype == dtype else grad_h[start:end].copy_(
                torch.mm(g, w))  # (C, d)
        if grad_w is not None:
            if dtype == torch.float32:
                grad_w.addmm_(g.t(), h)  # (V, d); no (V, d) temporary per chunk
            else:
                grad_w.add_(torch.mm(g.t(), h).float())
    return loss, grad_h, None if grad_w is None else grad_w.to(weight.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss in forward; the gradients too, saved whole and scaled by the incoming grad in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, ignore_index, dtype, need_h, need_w):
        loss, grad_h, grad_w = _fused_forward(
            hidden, weight, targets, chunk_tokens, ignore_index, dtype, need_h, need_w
        )
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        # out of place: the saved gradients must survive a second backward (retain_graph=True)
        gh = None if grad_h is None else grad_h * grad_loss.to(grad_h.dtype)
        gw = None if grad_w is None else grad_w * grad_loss.to(grad_w.dtype)
        return gh, gw, None, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Sum over tokens of cross_entropy(hidden @ weight.T, targets) in fp32 (targets == ignore_index
    carry no loss), computed chunk_tokens rows at a time so the (N, V) logits never exist whole.

    hidden (..., d), weight (V, d), targets (...) int64. Returns a 0-dim float32 tensor equal to
    F.cross_entropy(F.linear(hidden, weight).float().view(-1, V), targets.view(-1), reduction="sum").
    Under autocast the matmuls run in the autocast dtype, as F.linear's would.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if weight.dim() != 2 or hidden.size(-1) != weight.size(1):
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match weight {tuple(weight.shape)} (V, d)")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets {tuple(targets.shape)} must match hidden's leading dims {tuple(hidden.shape[:-1])}"
        )
    dtype = _compute_dtype(hidden, weight)
    grad_on = torch.is_grad_enabled()
    need_h, need_w = grad_on and hidden.requires_grad, grad_on and weight.requires_grad
    h2 = hidden.reshape(-1, hidden.size(-1))  # (N, d)
    t1 = targets.reshape(-1)  # (N,)
    if not (need_h or need_w):
        return _fused_forward(h2, weight, t1, chunk_tokens, ignore_index, dtype, False, False)[0]
    return _ChunkedLinearCrossEntropy.apply(h2, weight, t1, chunk_tokens, ignore_index, dtype, need_h, need_w)
