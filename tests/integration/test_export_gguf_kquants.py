"""lmforge's Q4_K / Q6_K blocks against llama.cpp's own quantizer (the llama.cpp tier): the same float32
matrices, written as one F32 GGUF, are quantized by `llama_model_quantize` (Q4_K_M, no importance
matrix: the reference search lmforge's kquants.py follows) and by lmforge; both files are read back with
gguf-py. lmforge's error is never above llama.cpp's and, on x86-64, the blocks are the same bytes."""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


def _matrices() -> dict[str, np.ndarray]:
    """One small llama layer's worth of tensors with Gaussian and heavy-tailed rows. Q4_K_M on a 1-layer
    model keeps attn_v, ffn_down and output at Q6_K and writes the rest as Q4_K, so both types are met."""
    rng = np.random.default_rng(0)
    outliers = 0.02 * rng.standard_normal((256, 512))
    outliers[rng.random(outliers.shape) < 0.002] = 3.0  # a few large weights, as trained models have
    shifted = rng.standard_normal((300, 256)) + 0.5 + 0.1 * rng.standard_t(1, (300, 256))
    tiny = rng.standard_normal((256, 256))
    tiny[:8, :64] *= 1e-39  # float32 subnormals: a Q4_K sub-block scale overflows, as it does in llama.cpp
    return {
        "token_embd.weight": shifted,
        "blk.0.attn_q.weight": tiny,
        "blk.0.ffn_up.weight": rng.standard_t(2, (512, 256)),
        "blk.0.ffn_gate.weight": rng.standard_t(3, (512, 256)) * 1e-3,
        "blk.0.attn_v.weight": rng.standard_normal((256, 256)),
        "blk.0.ffn_down.weight": outliers,
        "output.weight": rng.standard_t(2, (300, 256)),
    }


def _llama_cpp_q4_k_m(llama_cpp, mats: dict[str, np.ndarray], tmp_path) -> dict:
    writer = gguf.GGUFWriter(str(tmp_path / "f32.gguf"), "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 256),
                       ("feed_forward_length", 512), ("attention.head_count", 4),
                       ("attention.head_count_kv", 4)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for name, arr in mats.items():
        writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 2
    out = tmp_path / "q4_k_m.gguf"
    assert llama_cpp.llama_model_quantize(str(tmp_path / "f32.gguf").encode(), str(out).encode(),
                                          ctypes.byref(params)) == 0
    return {t.name: t for t in gguf.GGUFReader(out).tensors}


def _rel_rms(data: np.ndarray, qtype, x: np.ndarray) -> float:
    back = gguf.quants.dequantize(data, qtype).reshape(x.shape)
    return float(np.sqrt(((back - x) ** 2).mean() / (x ** 2).mean()))


def test_llama_cpp_quantizer_writes_our_k_quant_blocks(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the optional "
                                    "llama.cpp tier: bash scripts/llama_cpp_tier.sh builds it, ~4 minutes)")
    from gguf import GGMLQuantizationType as T

    from lmforge.finetune import kquants

    mats = {name: arr.astype(np.float32) for name, arr in _matrices().items()}
    theirs = _llama_cpp_q4_k_m(llama_cpp, mats, tmp_path)
    # the float32 order of operations decides ties; ggml-base is built without FMA contraction on x86-64
    # (no -march there), where our order is theirs, so there the bytes must agree
    same_bytes = platform.machine().lower() in ("x86_64", "amd64")
    types = set()
    for name, x in mats.items():
        tensor = theirs[name]
        qtype = T(tensor.tensor_type)
        assert qtype in (T.Q4_K, T.Q6_K), (name, qtype.name)
        types.add(qtype)
        ours = kquants.quantize(x, qtype)
        ref = np.array(tensor.data).reshape(ours.shape)
        err, err_ref = _rel_rms(ours, qtype, x), _rel_rms(ref, qtype, x)
        identical = np.array_equal(ours, ref)
        print(f"{name} {qtype.name}: relative RMS lmforge {err:.5f}, llama.cpp {err_ref:.5f}, "
              f"bytes {'identical' if identical else 'differ'}")
        assert err <= 1.02 * err_ref, (name, err, err_ref)
        if same_bytes:
            assert identical, name
    assert types == {T.Q4_K, T.Q6_K}


def test_llama_cpp_falls_back_to_the_types_lmforge_chooses(tmp_path):
    """Rows that fill no 256-block (a 704-wide ffn_down, as the demo model's): llama.cpp's quantizer falls
    back to Q5_0 for a Q4_K tensor and Q8_0 for a Q6_K one, to F16 where 32 does not divide the row;
    lmforge's export chooses the same types and gguf-py's Q5_0 / Q8_0 are llama.cpp's bytes."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the optional "
                                    "llama.cpp tier: bash scripts/llama_cpp_tier.sh builds it, ~4 minutes)")
    from gguf import GGMLQuantizationType as T

    from lmforge.finetune.gguf import _choose, _encode
    from lmforge.finetune.kquants import role_of

    rng = np.random.default_rng(1)
    mats = {"token_embd.weight": rng.standard_normal((300, 256)),
            "blk.0.attn_q.weight": rng.standard_normal((256, 704)),    # Q4_K -> Q5_0
            "blk.0.ffn_down.weight": rng.standard_normal((256, 704)),  # Q6_K (more bits) -> Q8_0
            "blk.0.ffn_gate.weight": rng.standard_normal((64, 100)),   # no 32-block either -> F16
            "output.weight": rng.standard_normal((300, 256))}
    mats = {name: arr.astype(np.float32) for name, arr in mats.items()}
    theirs = _llama_cpp_q4_k_m(llama_cpp, mats, tmp_path)
    for name, x in mats.items():
        qtype = _choose(gguf, list(x.shape), "q4_k_m", role_of(name, False, 1))
        assert T(theirs[name].tensor_type) == qtype, (name, qtype.name, T(theirs[name].tensor_type).name)
        if qtype in (T.Q5_0, T.Q8_0):
            ours = _encode(gguf, x, qtype)
            assert np.array_equal(ours, np.array(theirs[name].data).reshape(ours.shape)), name
