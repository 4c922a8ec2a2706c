"""The two k-quant block types of llama.cpp's Q4_K_M mix, quantized here because gguf-py (0.19) only
dequantizes them: Q4_K (4-bit, 256 values per block in 8 sub-blocks of 32, each with a 6-bit scale and
a 6-bit min) and Q6_K (6-bit, 16 sub-blocks of 16 with int8 scales). The byte layouts are ggml's
(block_q4_K / block_q6_K); tests/integration/test_export_gguf.py checks every byte layout through
gguf-py's dequantizer and the whole file through transformers' loader.

The scales are found in one pass (range per sub-block, then the scales themselves quantized), not by
llama.cpp's iterative search, so the error is somewhat above llama.cpp's for the same type."""

from __future__ import annotations

import re

import numpy as np

QK_K = 256


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


def quantize(arr: np.ndarray, qtype) -> np.ndarray:
    """(..., cols) float32 -> (..., cols // 256 * block bytes) uint8 of Q4_K or Q6_K blocks (a stack of
    experts' matrices too: blocks run along the last axis)."""
    from gguf import GGMLQuantizationType as T

    *lead, cols = arr.shape
    assert cols % QK_K == 0, cols
    blocks = arr.astype(np.float32).reshape(-1, QK_K)
    data = _q4_k(blocks) if qtype == T.Q4_K else _q6_k(blocks)
    return data.reshape(*lead, -1)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _q4_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)  # (n, 8): a sub-block's offset is subtracted, so min <= 0
    hi = sub.max(axis=2)
    scale, mins = (hi - lo) / 15.0, -lo
    d = scale.max(axis=1, keepdims=True) / 63.0  # (n, 1): the 6-bit scales' own scale
    dmin = mins.max(axis=1, keepdims=True) / 63.0
    sc = np.clip(np.rint(_div(scale, d)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_div(mins, dmin)), 0, 63).astype(np.uint8)
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    # quantize against the scales as stored (f16, 6-bit), so the dequantized values are the nearest ones
    step = d16.astype(np.float32) * sc
    off = dmin16.astype(np.float32) * m
    q = np.clip(np.rint(_div(sub + off[..., None], step[..., None])), 0, 15).astype(np.uint8)  # (n, 8, 32)
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    # each 32 bytes of qs hold two sub-blocks: the even one in the low nibbles, the odd one in the high
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(n, 128)
    return np.concatenate([d16.view(np.uint8), dmin16.view(np.uint8), scales, qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    amax = np.abs(sub).max(axis=2)
    scale = amax / 31.0  # (n, 16): values map to -31..31 (the type holds -32..31)
    d = np.abs(scale).max(axis=1, keepdims=True) / 127.0
    sc = np.clip(np.rint(_div(scale, d)), -128, 127).astype(np.int8)
    d16 = d.astype(np.float16)
    step = d16.astype(np.float32) * sc
    q = (np.clip(np.rint(_div(sub, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    # per half of 128 values: ql packs quarters 0|2 and 1|3 as low|high nibbles, qh the top 2 bits of all four
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2).reshape(n, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8)], axis=1)
