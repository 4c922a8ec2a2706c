"""`lmforge export RUN OUT.gguf --format gguf --quant f16|q8_0|q4_0|q4_k_m`: a run as one GGUF file
for llama.cpp / Ollama, with the tokenizer and chat template in its metadata and an Ollama Modelfile
beside it (OUT.Modelfile).

The run is first exported as a Hugging Face dir (`export_run`: adapters merged, template kept) into a
scratch dir beside OUT; that dir is then written as GGUF the way llama.cpp's own converter reads a
Hugging Face checkpoint (tensor names from gguf-py's name map, the Q/K row order llama.cpp's `llama`
architecture rotates, its metadata keys). OUT and the Modelfile are renamed into place at the end, so a
refusal or failure leaves whatever was there untouched.

Quantization: gguf-py quantizes Q8_0 and Q4_0 itself (gguf.quants); Q4_K and Q6_K (q4_k_m) it only
dequantizes, so lmforge writes those blocks itself (finetune/kquants.py), checked against gguf-py's
dequantizer in the tests."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.errors import LmforgeError
from lmforge.utils.io import check_new_file

QUANTS = ("f16", "q8_0", "q4_0", "q4_k_m")
# Hugging Face model_type -> llama.cpp architecture. Mistral is llama.cpp's `llama` (its converter
# files MistralForCausalLM there too); the rest are families lmforge imports that llama.cpp has
# no exact counterpart for yet (or that need converter work not done here).
ARCHES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise LmforgeError("GGUF export needs the gguf package: pip install 'lmforge[gguf]'") from e
    return gguf


def export_gguf(src: str | Path, out: str | Path, quant: str = "f16", overwrite: bool = False,
                weights: str = "model", say=print) -> Path:
    """Write the model at `src` (run, checkpoint or Hugging Face dir) as the GGUF file `out` and an
    Ollama Modelfile beside it (`out` with the suffix .Modelfile)."""
    from lmforge.finetune.export import export_run

    gguf = _gguf()
    if quant not in QUANTS:
        raise LmforgeError(f"--quant {quant!r} is not supported; valid: {', '.join(QUANTS)}")
    out = Path(out)
    if out.suffix != ".gguf":
        raise LmforgeError(f"{out}: a GGUF export's output is a file whose name ends in .gguf")
    modelfile = out.with_suffix(".Modelfile")
    source = Path(src).resolve()
    for path in (out, modelfile):
        check_new_file(path, overwrite)
        if source == path.resolve() or source in path.resolve().parents:
            raise LmforgeError(f"{path} lies inside {src}, an input of this command; choose another path")
    _precheck(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        export_run(src, tmp / "hf", weights=weights, say=lambda *_: None)
        info = write_gguf(gguf, tmp / "hf", tmp / out.name, quant, name=str(src), say=say)
        from lmforge.finetune.ollama import modelfile_text

        if info["chat_template"] is not None and info["shape"] is None:
            say("note: the run's chat template is none of the shapes the Modelfile writes as a Go template "
                "(ChatML, Llama 3, Gemma, Mistral); the Modelfile has no TEMPLATE, and Ollama reads the "
                "template from the GGUF (tokenizer.chat_template)")
        (tmp / modelfile.name).write_text(
            modelfile_text(f"./{out.name}", info["shape"], info["chat_template"], info["stops"],
                           info["params"]), encoding="utf-8")
        for f in (tmp / out.name, tmp / modelfile.name):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp / out.name, out)
        os.replace(tmp / modelfile.name, modelfile)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = out.stat().st_size / 2**20
    say(f"exported {src} to {out} (GGUF {info['arch']}, {quant}, {size:.1f} MiB) and {modelfile}")
    return out


def _precheck(src: str | Path) -> None:
    """Refuse a family llama.cpp has no architecture for before the (full-size) Hugging Face export."""
    from lmforge.checkpoint.runs import run_config
    from lmforge.models.hf.convert import export_model_type

    cfg, _ = run_config(src)
    if cfg.model.score_head:
        raise LmforgeError(f"{src} is a reward model (a score head); GGUF export writes causal language "
                           "models")
    model_type = export_model_type(cfg.model)
    if model_type not in ARCHES:
        raise LmforgeError(f"GGUF export does not support model_type {model_type!r}; supported: "
                           f"{', '.join(sorted(ARCHES))} (use --format hf for the others)")


def _llama_order(t: torch.Tensor, hf_name: str, arch: str, n_heads: int, n_kv: int) -> torch.Tensor:
    if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return _permute_rope_rows(t, n_heads)
    if arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return _permute_rope_rows(t, n_kv)
    return t


def _permute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face's Llama rotates each head's two halves against each other; llama.cpp's `llama`
    architecture rotates adjacent pairs. Reorder a q/k projection's rows (out features, per head)
    from halves to pairs, so that the same rotation lands on the same numbers."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Tensors:
    """The safetensors of a Hugging Face dir, read one tensor at a time (a model never sits in memory
    twice: the writer plans every tensor first and then reads, converts and writes them in turn)."""

    def __init__(self, hf_dir: Path) -> None:
        from safetensors import safe_open

        index = hf_dir / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
                 else ["model.safetensors"])
        self._files = [safe_open(hf_dir / f, framework="pt") for f in files]
        self.where = {name: f for f in self._files for name in f.keys()}

    def shape(self, name: str) -> list[int]:
        return list(self.where[name].get_slice(name).get_shape())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)


def _check_family(cfg: dict[str, Any]) -> str:
    model_type = cfg.get("model_type")
    if model_type not in ARCHES:
        raise LmforgeError(f"GGUF export does not support model_type {model_type!r}; supported: "
                           f"{', '.join(sorted(ARCHES))} (use --format hf for the others)")
    arch = (cfg.get("architectures") or [""])[0]
    if not arch.endswith("ForCausalLM"):
        raise LmforgeError(f"GGUF export writes causal language models; this one is {arch} (a reward model?)")
    if cfg.get("mlp_bias") or cfg.get("attention_bias"):
        raise LmforgeError("GGUF export does not support a Llama with attention_bias / mlp_bias (llama.cpp's "
                           "converter drops some of those biases); use --format hf")
    return ARCHES[model_type]


def _rope_keys(gguf, writer, cfg: dict[str, Any], arch: str, head_dim: int) -> torch.Tensor | None:
    """Write the RoPE keys; returns the `rope_freqs` tensor llama.cpp takes Llama 3.1's scaling as (each
    frequency's divisor), or None."""
    from lmforge.models.hf import rope

    params = rope.rope_params(cfg)
    kind = rope.rope_kind(params)
    theta = rope.rope_theta(cfg, params)
    writer.add_rope_freq_base(theta)
    if kind == "default":
        return None
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(params["factor"]))
        return None
    scaling, _ = rope.scaling_from_hf(params, int(cfg.get("max_position_embeddings", 2048)))
    if kind == "llama3" and arch == "llama":
        from types import SimpleNamespace

        from lmforge.models.common.rope import inv_frequencies

        # lmforge's own Llama 3.1 frequencies, as divisors of the plain ones: exactly what we compute
        original = scaling["original_max_position_embeddings"]
        ours = inv_frequencies(head_dim, theta, SimpleNamespace(**scaling), original)
        return inv_frequencies(head_dim, theta) / ours
    plain_yarn = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
    if kind == "yarn" and all(scaling.get(k, v) == v for k, v in plain_yarn.items()) and not any(
            k in scaling for k in ("mscale", "mscale_all_dim", "attention_factor")):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        return None
    raise LmforgeError(f"GGUF export supports RoPE scaling none, linear, yarn (default betas, no mscale or "
                       f"attention_factor) and llama3 (Llama only); this {arch} model has {kind!r} {params}")


def _context_length(cfg: dict[str, Any], say) -> int:
    """max_position_embeddings, capped at a sliding window: llama.cpp's llama/qwen2/qwen3 attend to the
    whole context, which equals sliding-window attention only while the context fits in the window."""
    ctx = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", cfg.get("model_type") == "mistral")
    if uses_window and window is not None and int(window) < ctx:
        say(f"note: the model attends over a sliding window of {window} tokens, which llama.cpp's "
            f"{cfg['model_type']} does not have; the GGUF's context length is set to {window} (not {ctx}), "
            "where both compute the same")
        return int(window)
    return ctx


def _choose(gguf, shape: list[int], quant: str, role: str):
    """The GGML type of one tensor. Vectors (norms, biases) stay F32, as llama.cpp keeps them; a
    matrix whose rows do not fill whole quantization blocks falls back to F16 (llama.cpp falls back too).
    `role` 'output' (the LM head, or the tied embedding that serves as one) keeps 8 bits under q4_0,
    where llama.cpp's quantizer keeps 6 (Q6_K, which q4_k_m writes)."""
    from lmforge.finetune import kquants

    T = gguf.GGMLQuantizationType
    if len(shape) == 1:
        return T.F32
    want = {"f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}.get(quant)
    if quant == "q4_k_m":
        want = kquants.q4_k_m_type(role)
    if quant == "q4_0" and role == "output":
        want = T.Q8_0
    if want != T.F16 and shape[-1] % gguf.GGML_QUANT_SIZES[want][0] != 0:
        # a K-quant needs rows of 256; llama.cpp's fallback for 32-multiples is 8-bit, else 16-bit
        want = T.Q8_0 if want in (T.Q4_K, T.Q6_K) and shape[-1] % 32 == 0 else T.F16
    return want


def _nbytes(gguf, shape: list[int], qtype) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def _encode(gguf, arr: np.ndarray, qtype) -> np.ndarray:
    from lmforge.finetune import kquants

    T = gguf.GGMLQuantizationType
    if qtype == T.F32:
        return arr.astype(np.float32)
    if qtype == T.F16:
        return arr.astype(np.float16)
    if qtype in (T.Q4_K, T.Q6_K):
        return kquants.quantize(arr, qtype)
    return gguf.quants.quantize(arr, qtype)


def write_gguf(gguf, hf_dir: Path, path: Path, quant: str, name: str, say=print) -> dict[str, Any]:
    """Write the Hugging Face dir `hf_dir` as the GGUF file `path`; returns what the Modelfile needs."""
    from lmforge.finetune.gguf_vocab import read_vocab
    from lmforge.finetune.kquants import role_of

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = _check_family(cfg)
    tensors = _Tensors(hf_dir)
    n_vocab = tensors.shape("model.embed_tokens.weight")[0]
    vocab = read_vocab(hf_dir, n_vocab, label=f"the tokenizer of {name}")
    n_layers, d, n_heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or d // n_heads
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(arch_enum, n_layers)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(Path(name).resolve().name)
    writer.add_type("model")
    writer.add_vocab_size(n_vocab)
    writer.add_context_length(_context_length(cfg, say))
    writer.add_embedding_length(d)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    rope_freqs = _rope_keys(gguf, writer, cfg, arch, head_dim)
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                 "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M}[quant]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab.write(writer)

    tied = "lm_head.weight" not in tensors.where or bool(cfg.get("tie_word_embeddings"))
    plan = []  # (tensor source, GGML type): every tensor's entry is written before any data
    if rope_freqs is not None:
        writer.add_tensor_info("rope_freqs.weight", list(rope_freqs.shape), np.dtype(np.float32),
                               rope_freqs.numel() * 4, raw_dtype=gguf.GGMLQuantizationType.F32)
        plan.append((lambda: rope_freqs, gguf.GGMLQuantizationType.F32))
    for hf_name in tensors.where:
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise LmforgeError(f"GGUF export: no llama.cpp name for tensor {hf_name!r} of a {arch} model")
        shape = tensors.shape(hf_name)
        qtype = _choose(gguf, shape, quant, role_of(gname, tied, n_layers))
        nbytes = _nbytes(gguf, shape, qtype)
        writer.add_tensor_info(gname, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        plan.append((lambda n=hf_name: _llama_order(tensors[n], n, arch, n_heads, n_kv), qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for fetch, qtype in plan:
        writer.write_tensor_data(_encode(gguf, fetch().to(torch.float32).numpy(), qtype))
    writer.close()

    stops = [vocab.tokens[i] for i in vocab.stop_ids]
    gen = json.loads((hf_dir / "generation_config.json").read_text()) if (
        hf_dir / "generation_config.json").is_file() else {}
    # Ollama's own defaults (temperature 0.8, top_k 40, top_p 0.9) would sample differently from
    # `lmforge serve`; the run's generation_config wins, else serve's (OpenAI's) defaults, top_k off.
    params: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("repetition_penalty", "repeat_penalty")):
        if gen.get(ours) is not None:
            params[theirs] = gen[ours]
    return {"arch": arch, "chat_template": vocab.chat_template, "stops": stops, "params": params,
            "shape": _shape(vocab)}


def _shape(vocab) -> str | None:
    """The Modelfile TEMPLATE shape of the run's chat template (None: no template, or no known shape)."""
    if vocab.chat_template is None:
        return None
    from lmforge.data.chat_template import ChatTemplate
    from lmforge.finetune.ollama import match_shape

    def text(i: int | None) -> str:
        return vocab.tokens[i] if i is not None else ""

    specials = {"bos_token": text(vocab.bos_id), "eos_token": text(vocab.eos_id)}
    template = ChatTemplate(vocab.chat_template, specials, name="the run's chat template")
    bos = text(vocab.bos_id) if vocab.add_bos else ""  # llama.cpp adds it; the Go template must not
    return match_shape(lambda messages: template.render(messages, add_generation_prompt=True), bos)
