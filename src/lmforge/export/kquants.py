"""The two k-quant block types of llama.cpp's Q4_K_M mix, quantized here because gguf-py (0.19) only
dequantizes them: Q4_K (4-bit, 256 values per block in 8 sub-blocks of 32, each with a 6-bit scale and
a 6-bit min) and Q6_K (6-bit, 16 sub-blocks of 16 with int8 scales). The byte layouts are ggml's
(block_q4_K / block_q6_K); tests/integration/test_export_gguf.py checks every byte layout through
gguf-py's dequantizer and the whole file through transformers' loader.

The scales are searched as llama.cpp's reference quantizers search them (quantize_row_q4_K_ref with
make_qkx2_quants, quantize_row_q6_K_ref with make_qx_quants: the path `llama-quantize` takes without an
importance matrix): a few candidate scales per sub-block, each refined by a weighted least-squares fit,
the best kept. Every step is float32 in llama.cpp's order of operations (its sums run element by
element, so ours do too, one row of a (values, sub-blocks) array at a time), which makes the blocks
byte-identical to llama.cpp's (tests/integration/test_export_gguf_kquants.py compares them)."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np

QK_K = 256
_CHUNK = 2048  # blocks quantized together: (32, 16384) float32 work arrays of 2 MiB stay in cache
_F = np.float32
_EPS = _F(1e-15)  # llama.cpp's GROUP_MAX_EPS: a sub-block below it is all zero


def _use_more_bits(layer: int, n_layers: int) -> bool:
    # Q4_K_M's rule: the first and last eighth of the layers, and every third one between, keep
    # attn_v and ffn_down at 6 bits (they carry most of the quantization error).
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def role_of(gguf_name: str, tied: bool, n_layers: int) -> str:
    """'output' (the LM head, or the tied embedding serving as one), 'more_bits' (a Q4_K_M tensor kept
    at 6 bits) or 'plain'."""
    if gguf_name == "output.weight" or (tied and gguf_name == "token_embd.weight"):
        return "output"
    # as llama.cpp's quantizer: ffn_down of the experts (_exps) and of the shared expert (_shexp) too
    m = re.fullmatch(r"blk\.(\d+)\.(attn_v|ffn_down|ffn_down_exps|ffn_down_shexp)\.weight", gguf_name)
    if m and _use_more_bits(int(m.group(1)), n_layers):
        return "more_bits"
    return "plain"


def q4_k_m_type(role: str):
    from gguf import GGMLQuantizationType as T

    return T.Q6_K if role in ("output", "more_bits") else T.Q4_K


def quantize(arr: np.ndarray, qtype, threads: int | None = None) -> np.ndarray:
    """(..., cols) float32 -> (..., cols // 256 * block bytes) uint8 of Q4_K or Q6_K blocks (a stack of
    experts' matrices too: blocks run along the last axis). Chunks of blocks are quantized on `threads`
    threads (default: the cores this process may use); numpy releases the GIL inside each operation,
    and the result does not depend on the number of threads."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    *lead, cols = arr.shape
    assert cols % QK_K == 0, cols
    blocks = arr.astype(np.float32).reshape(-1, QK_K)
    one = _q4_k if qtype == T.Q4_K else _q6_k
    chunks = [blocks[i:i + _CHUNK] for i in range(0, max(len(blocks), 1), _CHUNK)]
    threads = min(threads or _cores(), len(chunks))
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            parts = list(pool.map(one, chunks))
    else:
        parts = [one(c) for c in chunks]
    return np.concatenate(parts).reshape(*lead, cols // QK_K * GGML_QUANT_SIZES[qtype][1])


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _rint(a: np.ndarray) -> np.ndarray:
    # llama.cpp's nearest_int rounds half to even, as np.rint does, for |a| < 2^22 (the range it asserts)
    return np.rint(a, out=a)


def _nearest_int(a: np.ndarray) -> np.ndarray:
    """llama.cpp's nearest_int bit for bit (as float32), outside its asserted range too: the low 23 bits
    of a + 1.5 * 2^23 less 2^22, so inf gives -2^22 and NaN 0. Where a scale overflows (sub-blocks of
    values near float32's smallest), llama.cpp's levels come from exactly this."""
    bits = (a.astype(np.float32) + _F(12582912)).view(np.int32)
    return ((bits & 0x7FFFFF) - 0x400000).astype(np.float32)


def _sum(a: np.ndarray) -> np.ndarray:
    """(k, S) -> (S,): summed element by element in order, as llama.cpp's loops sum (numpy's own
    reduction sums pairwise, which rounds differently)."""
    acc = a[0].copy()
    for row in a[1:]:
        acc += row
    return acc


def _fit_q4(x: np.ndarray):
    """make_qkx2_quants(32, 15, x, weights, ..., rmin=-1, rdelta=0.1, nstep=20, use_mad=false) for
    every sub-block at once: x (32, S), values down the columns. Returns (scale (S,), min (S,) >= 0
    as subtracted, L (32, S) float levels 0..15)."""
    n = x.shape[0]
    av_x = np.sqrt(_sum(x * x) / _F(n))
    w = av_x + np.abs(x)
    sum_w, sum_x = _sum(w), _sum(w * x)
    x_min = x.min(axis=0)
    lo = np.minimum(x_min, _F(0))
    hi = x.max(axis=0)
    flat = hi == lo
    lo = np.where(flat, _F(0), lo)  # (a constant sub-block is left out of the search below)
    x_buf = np.empty_like(x)
    iscale = _F(15) / (hi - lo)
    scale = _F(1) / iscale
    la, t = np.empty_like(x), np.empty_like(x)  # work arrays, reused (speed)

    def levels(iscale, lo, out):  # clamp(nearest_int(iscale * (x - lo)), 0, 15)
        np.subtract(x, lo, out=out)
        out *= iscale
        # |iscale * (x - lo)| is bounded per sub-block by its ends: np.rint is nearest_int unless a scale
        # overflowed (a span near float32's smallest values), then the exact but slower emulation
        bound = np.abs(iscale) * np.maximum(np.abs(hi - lo), np.abs(x_min - lo))
        if (bound < _F(2**21)).all():
            _rint(out)
        else:
            out[...] = _nearest_int(out)
        return np.clip(out, _F(0), _F(15), out=out)

    def error(s, m, lv, out):  # sum of w * (s * l + m - x)^2, in that order
        np.multiply(s, lv, out=out)
        out += m
        out -= x
        out *= out
        out *= w
        return _sum(out)

    # the levels of the best fit are recomputed once at the end from its (iscale, min) rather than kept
    # at every improvement (a pass over all values per step saved)
    best_iscale, best_lo = iscale, lo
    best = error(scale, lo, levels(iscale, lo, la), t)
    for step in range(21):
        # as llama.cpp's loop: each candidate is laid over the best fit's min so far, not the range's
        iscale = (_F(-1) + _F(0.1) * _F(step) + _F(15)) / (hi - lo)
        levels(iscale, lo, la)
        wl = np.multiply(w, la, out=t)
        sum_l = _sum(wl)
        sum_xl = _sum(np.multiply(wl, x, out=x_buf))
        sum_l2 = _sum(np.multiply(wl, la, out=t))
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, _F(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        pos = this_min > 0  # a positive offset is not representable (the min is subtracted): refit without
        this_min = np.where(pos, _F(0), this_min)
        this_scale = np.where(pos, sum_xl / np.where(sum_l2 != 0, sum_l2, _F(1)), this_scale)
        cur = error(this_scale, this_min, la, t)
        better = ok & (cur < best) & ~flat
        best_iscale = np.where(better, iscale, best_iscale)
        best_lo = np.where(better, lo, best_lo)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        lo = np.where(better, this_min, lo)
    L = levels(best_iscale, best_lo, la)
    # a constant sub-block (max == min): levels 0, scale 0, the min its value (or 0 when positive)
    lo = np.where(flat, np.minimum(hi, _F(0)), lo)
    return np.where(flat, _F(0), scale), -lo, np.where(flat, _F(0), L)


def _to_u8(a: np.ndarray) -> np.ndarray:
    # C's uint8_t = nearest_int(...) wraps a negative int; the MIN(63, .) after it then clamps
    return np.minimum(_nearest_int(a).astype(np.int64) & 0xFF, 63).astype(np.uint8)


def _q4_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(n * 8, 32).T)  # (32, n*8): one sub-block per column
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scales, mins, L = _fit_q4(sub)
        scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
        # as llama.cpp's `if (scale > max_scale)` from 0: a NaN (from a float32 overflow) never wins
        max_scale = np.fmax(np.fmax.reduce(scales, axis=1), _F(0))
        max_min = np.fmax(np.fmax.reduce(mins, axis=1), _F(0))
        inv_scale = np.where(max_scale > 0, _F(63) / max_scale, _F(0))
        inv_min = np.where(max_min > 0, _F(63) / max_min, _F(0))
        sc = _to_u8(inv_scale[:, None] * scales)
        m = _to_u8(inv_min[:, None] * mins)
        d16 = (max_scale / _F(63)).astype(np.float16)
        dmin16 = (max_min / _F(63)).astype(np.float16)
        # the levels again against the scales as stored (f16 times 6 bits); a sub-block whose stored
        # scale is 0 keeps the search's levels, as llama.cpp's does
        d = (d16.astype(np.float32)[:, None] * sc).reshape(-1)
        dm = (dmin16.astype(np.float32)[:, None] * m).reshape(-1)
        fresh = np.clip(_nearest_int((sub + dm) / np.where(d != 0, d, _F(1))), 0, 15)
        L = np.where(d != 0, fresh, L)
    q = L.T.astype(np.uint8).reshape(n, 8, 32)
    scales_b = np.zeros((n, 12), np.uint8)
    scales_b[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales_b[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales_b[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    # each 32 bytes of qs hold two sub-blocks: the even one in the low nibbles, the odd one in the high
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(n, 128)
    return np.concatenate([d16.reshape(n, 1).view(np.uint8), dmin16.reshape(n, 1).view(np.uint8),
                           scales_b, qs], axis=1)


def _fit_q6(x: np.ndarray):
    """make_qx_quants(16, 32, x, L, rmse_type=1, NULL) for every sub-block at once: x (16, S). Returns
    (scale (S,), levels (16, S) in -32..31). The weights are x squared."""
    idx = np.abs(x).argmax(axis=0)
    peak = np.take_along_axis(x, idx[None], axis=0)[0]  # the signed value of largest magnitude (first)
    zero = np.abs(peak) < _EPS
    peak = np.where(zero, _F(1), peak)
    w = x * x
    wx = w * x
    la, t = np.empty_like(x), np.empty_like(x)  # work arrays, reused (speed)

    def levels(iscale, out):  # clamp(nearest_int(iscale * x), -32, 31); sum w x l; sum w l l
        np.multiply(iscale, x, out=out)
        np.clip(_rint(out), _F(-32), _F(31), out=out)
        sumlx = _sum(np.multiply(wx, out, out=t))
        np.multiply(w, out, out=t)
        return sumlx, _sum(np.multiply(t, out, out=t))

    best_iscale = _F(-32) / peak  # the best candidate's levels are recomputed from it at the end
    sumlx, suml2 = levels(best_iscale, la)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, _F(1)), _F(0))
    best = scale * sumlx
    for step in (-9, -8, -7, -6, -5, -4, -3, -2, -1, 1, 2, 3, 4, 5, 6, 7, 8, 9):
        iscale = -(_F(32) + _F(0.1) * _F(step)) / peak
        sumlx, suml2 = levels(iscale, la)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        best_iscale = np.where(better, iscale, best_iscale)
        scale = np.where(better, sumlx / np.where(suml2 > 0, suml2, _F(1)), scale)
        best = np.where(better, scale * sumlx, best)
    levels(best_iscale, la)
    return np.where(zero, _F(0), scale), np.where(zero, _F(-32), la)


def _q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(n * 16, 16).T)  # (16, n*16)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scales, L = _fit_q6(sub)
        scales = scales.reshape(n, 16)
        mag = np.abs(scales)
        mag[np.isnan(mag)] = 0  # as llama.cpp's `if (abs_scale > max_abs_scale)`: a NaN never wins
        pick = mag.argmax(axis=1)
        max_scale = np.take_along_axis(scales, pick[:, None], axis=1)[:, 0]  # signed, largest magnitude
        empty = ~(np.take_along_axis(mag, pick[:, None], axis=1)[:, 0] >= _EPS)  # written as all zero bytes
        iscale = _F(-128) / np.where(empty, _F(1), max_scale)
        d16 = np.where(empty, _F(0), _F(1) / iscale).astype(np.float16)
        sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
        sc[empty] = 0
        d = (d16.astype(np.float32)[:, None] * sc).reshape(-1)
        fresh = np.clip(_nearest_int(sub / np.where(d != 0, d, _F(1))), -32, 31)
        L = np.where(d != 0, fresh, L)
    q = (L.T + 32).astype(np.uint8).reshape(n, 16 * 16)
    q[empty] = 0
    q = q.reshape(n, 2, 4, 32)
    # per half of 128 values: ql packs quarters 0|2 and 1|3 as low|high nibbles, qh the top 2 bits of all four
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2).reshape(n, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d16.reshape(n, 1).view(np.uint8)], axis=1)
