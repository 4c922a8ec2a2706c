"""What the GGUF export tests (tests/integration/test_export_gguf*.py) share: the tokenizer their tiny
models use (the `tokenizer_file` fixture is in tests/conftest.py), building a random Hugging Face model of
a family and importing it into lmforge, the export itself, and the two reloads that decide correctness:
transformers' GGUF loader and llama.cpp (llama-cpp-python, the optional tier), each compared with lmforge's
logits as the max relative error max |ours - theirs| / max |ours|.

A family's test file keeps what is its own: the configs, and any weights set away from a random init."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.cli import main

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# max relative logit error per weight type (test_export_gguf's module doc has the measured values)
TOLERANCE = {"f16": 1e-2, "q8_0": 3e-2, "q4_0": 0.4, "q4_k_m": 0.4}
TEXT = "Hello world! The quick brown fox, 12345 times.\n  Tabs\tand   spaces ünïcödé 🙂 it's"
CHAT_SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
NO_LLAMA_CPP = ("llama-cpp-python is not installed (the optional llama.cpp tier: "
                "bash scripts/llama_cpp_tier.sh builds it, ~4 minutes)")


def hf_tokenizer(tokenizer_file: Path, specials: dict | None = None):
    """The tokenizer file as Hugging Face's fast tokenizer, with TEMPLATE as its chat template."""
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file),
                                                  **(specials or CHAT_SPECIALS))
    hf_tok.chat_template = TEMPLATE
    return hf_tok


def perturb_vectors(model, neutral: float = 1.0) -> None:
    """Norm weights `neutral` + 0.2 N(0, 1) (GPT-2 names its LayerNorms ln_*) and biases 0.1 N(0, 1), drawn
    from torch's global generator in parameter order: away from their neutral values, so a mix-up of them
    shows in the logits."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_((neutral + 0.2 * torch.randn_like(p)) if "norm" in n or "ln_" in n
                        else 0.1 * torch.randn_like(p))


def save_and_import(model, hf_tok, root: Path) -> Path:
    """`model` and its tokenizer saved to root/hf, `lmforge import`ed into root/imported (returned)."""
    model.save_pretrained(root / "hf")
    hf_tok.save_pretrained(root / "hf")
    assert main(["import", str(root / "hf"), str(root / "imported")]) == 0
    return root / "imported"


def model_cache(tmp_path_factory, build):
    """A module fixture's body: key -> (imported dir, lmforge's model of it, in eval mode), built by
    build(root, *key) under a fresh temporary dir once per key, on first use."""
    from lmforge.checkpoint.runs import load_model, run_config

    cache = {}

    def get(*key):
        if key not in cache:
            imported = build(tmp_path_factory.mktemp(str(key[0])), *key)
            cache[key] = imported, load_model(*run_config(imported))[0].eval()
        return cache[key]

    return get


def export(src: Path, out: Path, quant: str) -> None:
    assert main(["export", str(src), str(out), "--format", "gguf", "--quant", quant]) == 0


def gguf_fields(path: Path) -> dict:
    """The GGUF file's metadata: key -> gguf-py's field."""
    return {f.name: f for f in gguf.GGUFReader(path).fields.values()}


def random_ids(vocab: int, shape, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / ours.abs().max())


def rel_error(ours, gguf_path: Path, ids: torch.Tensor, **load) -> float:
    """Max relative error of transformers' logits, from the GGUF file alone (`load`: more from_pretrained
    arguments), against `ours` on `ids` (batch, seq)."""
    theirs = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                               dtype=torch.float32, **load).eval()
    with torch.no_grad():
        return _rel(ours(ids), theirs(ids).logits)


def llama_cpp():
    """llama-cpp-python, or a skip saying how to get it (the optional tier)."""
    return pytest.importorskip("llama_cpp", reason=NO_LLAMA_CPP)


def llama_cpp_model(path: Path):
    """llama.cpp's model of the GGUF file: a 64-token context, logits kept for every position."""
    return llama_cpp().Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)


def llama_cpp_error(llm, ours, ids: torch.Tensor) -> float:
    """Max relative error of llama.cpp's logits for the 1-D `ids` against `ours`."""
    llm.eval(ids.tolist())
    theirs = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    with torch.no_grad():
        return _rel(ours(ids[None])[0], theirs)


def spm_tokenizer(path, layout: str) -> None:
    """A sentencepiece-style BPE with byte fallback in Mistral's file layout (one Metaspace, no split) or
    Llama 2's (Prepend + Replace normalizers), trained on words (no token crosses a space) as
    sentencepiece trains; its <0xNN> byte tokens are vocabulary entries, not added tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    rng = np.random.default_rng(1)  # plus random words: many merges that compete for the same letters
    words = " ".join("".join(rng.choice(list("thequickbrownfoxjumps"), size=rng.integers(2, 9)))
                     for _ in range(4000))
    tok.train_from_iterator([TEXT * 30, "the quick brown fox 1234567 jumps " * 30, words],
                            trainers.BpeTrainer(vocab_size=700, special_tokens=specials, min_frequency=2))
    if layout == "mistral":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    else:
        tok.pre_tokenizer = None
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].startswith("<0x")]
    path.write_text(json.dumps(spec))
