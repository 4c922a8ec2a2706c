"""`lmforge export RUN OUT.gguf --format gguf --quant f16|q8_0|q4_0|q4_k_m`: a run as one GGUF file
for llama.cpp / Ollama, with the tokenizer and chat template in its metadata and an Ollama Modelfile
beside it (OUT.Modelfile).

The run is first exported as a Hugging Face dir (`export_run`: adapters merged, template kept) into a
scratch dir beside OUT; that dir is then written as GGUF the way llama.cpp's own converter reads a
Hugging Face checkpoint: tensor names from gguf-py's name map, each architecture's metadata keys and
tensor layout written by its family module in export/gguf_arch/ (one module per group of families).
OUT and the Modelfile are renamed into place at the end, so a refusal or failure leaves whatever was
there untouched.

Quantization: gguf-py quantizes Q8_0, Q5_0 and Q4_0 itself (gguf.quants); Q4_K and Q6_K (q4_k_m) it only
dequantizes, so lmforge writes those blocks itself (export/kquants.py: llama.cpp's reference search,
byte-identical to its quantizer; the llama.cpp tier checks it). The type of each tensor follows
llama.cpp's q4_k_m rules (`_choose`, kquants.role_of, a family's Planned.role)."""

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
from lmforge.export.gguf_arch import family
from lmforge.export.gguf_arch.common import Context
from lmforge.utils.io import check_new_file

QUANTS = ("f16", "q8_0", "q4_0", "q4_k_m")


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
    from lmforge.export.hf import export_run

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
        from lmforge.export.ollama import modelfile_text

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
    """Refuse a family llama.cpp has no architecture for, or a setting its architecture cannot hold,
    before the (full-size) Hugging Face export: the family's check reads the config.json the export
    will write (write_gguf checks the written one again)."""
    from lmforge.checkpoint.runs import run_config
    from lmforge.models.hf.convert import export_model_type, model_config_to_hf

    cfg, _ = run_config(src)
    if cfg.model.score_head:
        raise LmforgeError(f"{src} is a reward model (a score head); GGUF export writes causal language "
                           "models")
    model_type = export_model_type(cfg.model)
    family(model_type).check(model_config_to_hf(cfg.model, model_type=model_type))


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


def _check_family(cfg: dict[str, Any]):
    """The family module of a Hugging Face config, after its own checks."""
    module = family(cfg.get("model_type"))
    arch = (cfg.get("architectures") or [""])[0]
    if not arch.endswith(("ForCausalLM", "LMHeadModel")):  # GPT-2's causal LM is GPT2LMHeadModel
        raise LmforgeError(f"GGUF export writes causal language models; this one is {arch} (a reward model?)")
    module.check(cfg)
    return module


def _choose(gguf, shape: list[int], quant: str, role: str):
    """The GGML type of one tensor. Vectors (norms, biases) stay F32, as llama.cpp keeps them; a
    matrix whose rows do not fill whole quantization blocks falls back to F16 (llama.cpp falls back too).
    `role` 'output' (the LM head, or the tied embedding that serves as one) keeps 8 bits under q4_0,
    where llama.cpp's quantizer keeps 6 (Q6_K, which q4_k_m writes); 'q8_0' keeps 8 bits under both."""
    from lmforge.export import kquants

    T = gguf.GGMLQuantizationType
    if len(shape) == 1:
        return T.F32
    want = {"f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}.get(quant)
    if quant == "q4_k_m":
        want = kquants.q4_k_m_type(role)
    if (quant == "q4_0" and role == "output") or (quant in ("q4_0", "q4_k_m") and role == "q8_0"):
        want = T.Q8_0
    if want != T.F16 and shape[-1] % gguf.GGML_QUANT_SIZES[want][0] != 0:
        # a K-quant needs rows of 256; llama.cpp's quantizer falls back to a 32-block type (Q4_K -> Q5_0,
        # Q6_K -> Q8_0) where the row fits one, else to F16
        fallback = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}.get(want, T.F16)
        want = fallback if shape[-1] % gguf.GGML_QUANT_SIZES[fallback][0] == 0 else T.F16
    return want


def _nbytes(gguf, shape: list[int], qtype) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def _encode(gguf, arr: np.ndarray, qtype) -> np.ndarray:
    from lmforge.export import kquants

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
    from lmforge.export.gguf_vocab import read_vocab
    from lmforge.export.kquants import role_of

    cfg = json.loads((hf_dir / "config.json").read_text())
    module = _check_family(cfg)
    arch = module.ARCHES[cfg["model_type"]]
    tensors = _Tensors(hf_dir)
    n_vocab = tensors.shape("model.embed_tokens.weight")[0] if "model.embed_tokens.weight" in tensors.where \
        else int(cfg["vocab_size"])
    vocab = read_vocab(hf_dir, n_vocab, label=f"the tokenizer of {name}")
    for note in vocab.notes:
        say(note)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(Path(name).resolve().name)
    writer.add_type("model")
    writer.add_vocab_size(n_vocab)
    ctx = Context(gguf, writer, cfg, arch, tensors, say)
    module.metadata(ctx)
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                 "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M}[quant]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab.write(writer)

    tied = "lm_head.weight" not in tensors.where or bool(cfg.get("tie_word_embeddings"))
    plan = []  # (loader, GGML type): every tensor's entry is written before any data
    for item in module.plan(ctx):
        role = item.role or role_of(item.name, tied, ctx.n_layers)
        qtype = _choose(gguf, item.shape, quant, role) if item.quantize else gguf.GGMLQuantizationType.F32
        writer.add_tensor_info(item.name, item.shape, np.dtype(np.float32), _nbytes(gguf, item.shape, qtype),
                               raw_dtype=qtype)
        plan.append((item.load, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for load, qtype in plan:
        writer.write_tensor_data(_encode(gguf, load().to(torch.float32).numpy(), qtype))
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
    from lmforge.export.ollama import match_shape

    def text(i: int | None) -> str:
        return vocab.tokens[i] if i is not None else ""

    specials = {"bos_token": text(vocab.bos_id), "eos_token": text(vocab.eos_id)}
    template = ChatTemplate(vocab.chat_template, specials, name="the run's chat template")
    bos = text(vocab.bos_id) if vocab.add_bos else ""  # llama.cpp adds it; the Go template must not
    return match_shape(lambda messages: template.render(messages, add_generation_prompt=True), bos)
