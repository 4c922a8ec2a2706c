"""GPTQ (Frantar, Ashkboos, Hoefler & Alistarh 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", Algorithm 1): weights quantized one input column at a time, each
column's rounding error spread over the columns not yet quantized through the inverse Hessian of the
layer's reconstruction error ||W X - Q X||^2, H = 2 X X^T / n.

What this file does, and why:
- H is accumulated from calibration activations; a column whose input is always 0 (diag(H) = 0) gets
  H_jj = 1 and weight 0, since nothing constrains it.
- Damping: H += percdamp * mean(diag(H)) * I keeps the Cholesky stable (the paper's 1%).
- The upper Cholesky factor U of H^-1 (H^-1 = U^T U) gives, row by row, the inverse Hessians of the
  columns still left, so the sequential OBS updates become w_j's error times a row of U (the paper's
  "Cholesky reformulation"); `gptq_reference` is that sequential update written out slowly, for tests.
- Lazy batches: updates within a block of columns apply at once, the rest of W is updated once per block
  (a matrix product instead of K rank-1 updates).
- Groups: a group's scale / zero point is chosen from its weights as they are when quantization reaches
  its first column (earlier errors already folded in), with the primitives of lmforge.models.quant (the
  same rounding as RTN, so the two differ only in the feedback). With act_order (columns in order of
  decreasing diag(H)) the group parameters are chosen up front from the unchanged weights ("static
  groups"), so groups stay contiguous input ranges and the stored layout is the same.
"""

from __future__ import annotations

import torch

from lmforge.models.quant import choose_qparams, quantize


class Hessian:
    """Running 2 X X^T / n of a linear layer's inputs (K, K), in float64 for a stable sum."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.H = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        """Add inputs x (..., K)."""
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)  # (n, K)
        m = x.shape[0]
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.H += x.T @ x


def _quantizer(bits: int, group_size: int, symmetric: bool, scale_dtype: torch.dtype):
    """(qparams from weights (N, g), quantize-dequantize a column (N,) with them) at the given settings."""

    def params(w: torch.Tensor):
        scale, zero = choose_qparams(w.float(), bits, w.shape[1], symmetric, scale_dtype)
        return scale, zero  # (N, 1) each (zero None when symmetric)

    def qdq(col: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None):
        q = quantize(col[:, None].float(), scale, zero, bits, symmetric)  # (N, 1)
        deq = q.to(col.dtype) - (0 if zero is None else zero.to(col.dtype))
        return q[:, 0], (deq * scale.to(col.dtype))[:, 0]

    return params, qdq


def _prepare(W: torch.Tensor, H: torch.Tensor, percdamp: float) -> tuple[torch.Tensor, torch.Tensor]:
    W, H = W.clone(), H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    damp = percdamp * torch.mean(torch.diag(H))
    H += damp * torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    return W, H


@torch.no_grad()
def gptq_quantize(
    W: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, symmetric: bool,
    scale_dtype: torch.dtype = torch.bfloat16, percdamp: float = 0.01, blocksize: int = 128,
    act_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GPTQ of W (N, K) given H (K, K): integers (N, K) int8, scales (N, G) in `scale_dtype` and zero
    points (N, G) int32 (None when symmetric), G = K / group_size. Computes in H's dtype."""
    dtype = H.dtype
    N, K = W.shape
    if K % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={K}")
    W, H = _prepare(W.to(dtype), H, percdamp)
    params, qdq = _quantizer(bits, group_size, symmetric, scale_dtype)
    G = K // group_size
    scales: list[torch.Tensor | None] = [None] * G
    zeros: list[torch.Tensor | None] = [None] * G
    perm = torch.arange(K, device=W.device)
    if act_order:
        for g in range(G):  # static groups: from the unchanged weights, before any column moves
            scales[g], zeros[g] = params(W[:, g * group_size:(g + 1) * group_size])
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    # Upper Cholesky factor of H^-1: row j holds what quantizing column j does to the later columns.
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    # Blocks hold whole groups, so a group's parameters come from weights updated up to its first column.
    block = group_size * max(1, blocksize // group_size) if not act_order else blocksize
    Q = torch.zeros(N, K, dtype=torch.int8, device=W.device)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // group_size
            if not act_order and col % group_size == 0:
                scales[g], zeros[g] = params(W1[:, i:i + group_size])
            q, deq = qdq(W1[:, i], scales[g], zeros[g])
            Q[:, col] = q
            err = (W1[:, i] - deq) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    scale = torch.cat(scales, dim=1)  # (N, G)
    zero = None if symmetric else torch.cat(zeros, dim=1)
    return Q, scale, zero


@torch.no_grad()
def gptq_reference(
    W: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, symmetric: bool,
    scale_dtype: torch.dtype = torch.bfloat16, percdamp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The sequential OBS form of GPTQ without Cholesky or blocks (slow; for tests): quantize column j,
    W[:, j:] -= err_j * Hinv[j, j:] / Hinv[j, j], then drop j from the inverse Hessian by Gaussian
    elimination, Hinv -= Hinv[:, j] Hinv[j, :] / Hinv[j, j]. Same outputs as gptq_quantize (in order)."""
    N, K = W.shape
    W, H = _prepare(W.to(H.dtype), H, percdamp)
    params, qdq = _quantizer(bits, group_size, symmetric, scale_dtype)
    Hinv = torch.linalg.inv(H)
    Q = torch.zeros(N, K, dtype=torch.int8)
    scales, zeros = [], []
    for j in range(K):
        if j % group_size == 0:
            s, z = params(W[:, j:j + group_size])
            scales.append(s)
            zeros.append(z)
        q, deq = qdq(W[:, j], scales[-1], zeros[-1])
        Q[:, j] = q
        d = Hinv[j, j]
        W[:, j:] -= ((W[:, j] - deq) / d)[:, None] * Hinv[j, j:][None, :]
        Hinv = Hinv - Hinv[:, j:j + 1] @ Hinv[j:j + 1, :] / d
    return Q, torch.cat(scales, 1), None if symmetric else torch.cat(zeros, 1)
