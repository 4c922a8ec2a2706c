"""`lmforge export RUN OUT.gguf --format gguf`, verified by reloading: transformers' GGUF loader
(`from_pretrained(dir, gguf_file=...)`) rebuilds the model and the tokenizer from the file alone, and
its logits equal lmforge's within each weight type's quantization error; llama.cpp itself
(llama-cpp-python) is a further tier when installed.

Max relative logit error measured here (max |ours - theirs| / max |ours|; tiny random models, 256-wide
rows, 2 layers, Gaussian weights, which quantize worse than trained ones): f16 3e-4..7e-4 (the issue's
bound 1e-2), q8_0 1.2e-2, q4_0 0.23, q4_k_m 0.07..0.20 (llama 0.17, mistral 0.07, qwen2 0.16, qwen3
0.20); the bounds below sit above those (printed with -s). The layout (names, Q/K permutation) is
checked by f16's bound, which leaving out the Q permutation alone breaks (9e-2); the block bytes of the
4-bit types by gguf-py's dequantizer (test_k_quant_blocks_dequantize_with_gguf_py)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf_models import (
    TEMPLATE,
    TEXT,
    TOLERANCE,
    export,
    gguf,
    gguf_fields,
    hf_tokenizer,
    llama_cpp,
    llama_cpp_error,
    llama_cpp_model,
    model_cache,
    perturb_vectors,
    random_ids,
    rel_error,
    save_and_import,
    spm_tokenizer,
    transformers,
)

from lmforge.cli import main
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import LmforgeError

BASE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, max_position_embeddings=128, tie_word_embeddings=False)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # transformers reads a qwen3 GGUF with Qwen3Config's head_dim (128, every released Qwen3's), not
    # attention.key_length, which llama.cpp reads: so the test model has 128 too
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=128)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, tie_word_embeddings=True)),
}
CHAT = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"


def _imported(name: str, tokenizer_file, root, specials=None, **more):
    config_cls, model_cls, extra = FAMILIES[name]
    hf_tok = hf_tokenizer(tokenizer_file, specials)
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(vocab_size=len(hf_tok), **{**BASE, **extra, **more})
    model = getattr(transformers, model_cls)(cfg)
    perturb_vectors(model)
    return save_and_import(model, hf_tok, root)


@pytest.fixture(scope="module")
def families(tokenizer_file, tmp_path_factory):
    """name -> (imported dir, lmforge's model of it), each family imported once, on first use."""
    return model_cache(tmp_path_factory, lambda root, name: _imported(name, tokenizer_file, root))


# every family in f16 and the k-quant mix (its layout); the 8- and 4-bit block types on llama
RELOADS = [(f, q) for f in sorted(FAMILIES) for q in ("f16", "q4_k_m")]
RELOADS += [("llama", "q8_0"), ("llama", "q4_0")]


@pytest.mark.parametrize(("name", "quant"), RELOADS)
def test_transformers_reloads_the_gguf_with_equal_logits(families, name, quant, tmp_path):
    imported, ours = families(name)
    out = tmp_path / "model.gguf"
    export(imported, out, quant)
    ids = random_ids(ours.cfg.vocab_size, (2, 40))
    err = rel_error(ours, out, ids)
    print(f"{name} {quant}: max relative logit error {err:.2e}")
    assert err < TOLERANCE[quant], (name, quant, err)


def test_tokenizer_and_template_round_trip(families, tmp_path):
    imported, _ = families("qwen2")
    out = tmp_path / "model.gguf"
    export(imported, out, "q8_0")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    ours = Tokenizer.load(imported / "tokenizer.json")
    assert theirs.encode(TEXT, add_special_tokens=True) == ours.encode(TEXT)
    # a rendered chat: its special tokens are one token each on both sides (lmforge's encode_chat)
    assert theirs.encode(CHAT, add_special_tokens=True) == ours.encode_chat(CHAT)[0]
    assert len(ours.encode_chat(CHAT)[0]) < len(ours.encode(CHAT))
    reader = gguf.GGUFReader(out)
    fields = {f.name: f for f in reader.fields.values()}
    template = bytes(fields["tokenizer.chat_template"].parts[-1]).decode()
    assert template == TEMPLATE
    assert bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode() == "gpt-2"
    from lmforge.checkpoint.runs import run_config, run_tokenizer_file

    eos = int(fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    assert eos == Tokenizer.load(run_tokenizer_file(run_config(imported)[0])).eos_id  # lmforge's EOS
    # the tokenizer config's EOS (<|im_end|>, what the HF files say a reply ends with) stops too
    assert int(fields["tokenizer.ggml.eot_token_id"].parts[-1][0]) == ours.token_id("<|im_end|>") != eos
    modelfile = (tmp_path / "model.Modelfile").read_text()
    assert modelfile.count('PARAMETER stop "<|im_end|>"') == 1
    assert f'PARAMETER stop "{ours.decode([eos])}"' in modelfile
    assert "recognised as chatml" in modelfile and modelfile.startswith("# Written by lmforge")
    assert "FROM ./model.gguf\n" in modelfile


def test_k_quant_blocks_dequantize_with_gguf_py():
    """Our Q4_K / Q6_K bytes, read back by gguf-py's own dequantizer, give the values back within each
    type's step (the byte layout is the format's, else the values would come back scrambled)."""
    from gguf import GGMLQuantizationType as T

    from lmforge.finetune import kquants

    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[0] *= 1e-3
    x[1] = np.abs(x[1]) + 2  # all positive: the 4-bit min is 0
    x[2, :40] = 0
    for qtype, bound in ((T.Q4_K, 0.1), (T.Q6_K, 0.025)):
        back = gguf.quants.dequantize(kquants.quantize(x, qtype), qtype)
        rel = np.sqrt(((back - x) ** 2).mean(axis=1) / (x ** 2).mean(axis=1))
        assert rel.max() < bound, (qtype.name, rel)


def test_refusals_leave_existing_files_alone(families, tmp_path, capsys):
    imported, _ = families("llama")
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep")
    assert main(["export", str(imported), str(out), "--format", "gguf"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert out.read_bytes() == b"keep"
    assert main(["export", str(imported), str(tmp_path / "m.bin"), "--format", "gguf"]) == 2
    assert main(["export", str(imported), str(imported / "x.gguf"), "--format", "gguf"]) == 2
    assert main(["export", str(imported), str(tmp_path / "hf"), "--quant", "q8_0"]) == 2
    assert "--quant applies to --format gguf only" in capsys.readouterr().err
    for flag in (["--max-shard-gb", "1"], ["--adapter"]):  # the other exports' options: refused
        assert main(["export", str(imported), str(tmp_path / "x.gguf"), "--format", "gguf", *flag]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no scratch dir left behind
    assert main(["export", str(imported), str(out), "--format", "gguf", "--overwrite"]) == 0
    assert struct.unpack("<I", out.read_bytes()[4:8])[0] == 3  # GGUF version 3


def test_unsupported_family_is_refused_by_name(families, tmp_path, capsys, monkeypatch):
    """A model_type no GGUF family module claims (as if the run were one lmforge exports only as Hugging
    Face) is refused by name, with the supported list, before the full-size Hugging Face export."""
    from lmforge.finetune.gguf_arch import families as gguf_families

    imported, _ = families("llama")

    def no_export(*args, **kwargs):
        raise AssertionError("refused only after the full-size Hugging Face export")

    monkeypatch.setattr("lmforge.finetune.export.export_run", no_export)
    monkeypatch.setattr("lmforge.models.hf.convert.export_model_type", lambda *a, **k: "no_such_family")
    capsys.readouterr()
    assert main(["export", str(imported), str(tmp_path / "m.gguf"), "--format", "gguf"]) == 2
    err = capsys.readouterr().err
    assert "model_type 'no_such_family'" in err and ", ".join(sorted(gguf_families())) in err, err
    assert "gpt2" in gguf_families() and "llama" in gguf_families()
    assert list(tmp_path.iterdir()) == []


def test_a_setting_the_family_cannot_hold_is_refused_before_the_hf_export(tokenizer_file, tmp_path, capsys,
                                                                        monkeypatch):
    """The family module's check runs on the config.json the export would write, so a large run is
    refused at once, not after its full-size Hugging Face export."""
    imported = _imported("llama", tokenizer_file, tmp_path, attention_bias=True, mlp_bias=True)

    def no_export(*args, **kwargs):
        raise AssertionError("refused only after the full-size Hugging Face export")

    monkeypatch.setattr("lmforge.finetune.export.export_run", no_export)
    capsys.readouterr()
    assert main(["export", str(imported), str(tmp_path / "m.gguf"), "--format", "gguf"]) == 2
    assert "attention_bias" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()


def _split_tokenizer(path, regex: str, ignore_merges: bool = False) -> None:
    """A byte-level BPE that splits text with `regex` first (Qwen2's / Llama 3's layout), NFC-normalised."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT * 30, "the quick brown fox 1234567 jumps " * 30], trainer)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(path))


def test_a_qwen2_split_tokenizer_round_trips_and_an_unknown_split_is_refused(tmp_path, capsys):
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    _split_tokenizer(tmp_path / "tok.json", PRETOKENIZE_REGEX)
    imported = _imported("qwen2", tmp_path / "tok.json", tmp_path)
    export(imported, tmp_path / "m.gguf", "f16")
    fields = gguf_fields(tmp_path / "m.gguf")
    assert bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode() == "qwen2"
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    ours = Tokenizer.load(imported / "tokenizer.json")
    text = TEXT + " 1234567 and 89"
    assert theirs.encode(text, add_special_tokens=True) == ours.encode(text)
    assert len(ours.encode("1234567")) == 7  # Qwen2's split: one token per digit, in both

    _split_tokenizer(tmp_path / "odd.json", r"\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+")
    odd = _imported("qwen2", tmp_path / "odd.json", tmp_path / "odd")
    capsys.readouterr()
    assert main(["export", str(odd), str(tmp_path / "odd.gguf"), "--format", "gguf"]) == 2
    assert "not one llama.cpp knows by name" in capsys.readouterr().err
    assert not (tmp_path / "odd.gguf").exists()


def test_a_llama3_split_tokenizer_round_trips_and_needs_ignore_merges(tmp_path, capsys):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import _LLAMA3_SPLIT

    _split_tokenizer(tmp_path / "tok.json", _LLAMA3_SPLIT, ignore_merges=True)
    imported = _imported("llama", tmp_path / "tok.json", tmp_path)
    export(imported, tmp_path / "m.gguf", "q8_0")
    fields = gguf_fields(tmp_path / "m.gguf")
    assert bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode() == "llama-bpe"
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    text = TEXT + " 1234567"
    ours = Tokenizer.load(imported / "tokenizer.json")
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)

    _split_tokenizer(tmp_path / "plain.json", _LLAMA3_SPLIT, ignore_merges=False)
    plain = _imported("llama", tmp_path / "plain.json", tmp_path / "plain")
    capsys.readouterr()
    assert main(["export", str(plain), str(tmp_path / "p.gguf"), "--format", "gguf"]) == 2
    assert "ignore_merges=False with a llama-bpe split" in capsys.readouterr().err


def test_o200k_exports_as_gpt_4o_with_a_note_and_llama_cpp_tokenizes_it(tmp_path, capsys):
    """gpt-oss's o200k split: llama.cpp knows it as gpt-4o and runs an ASCII approximation of its regex,
    so the export says so; on English text, digits, code, Cyrillic and CJK the ids are lmforge's (checked
    by llama.cpp when installed: the name holds llama_cpp, so the tier runs it)."""
    from lmforge.finetune.gguf_vocab import _SPLITS

    o200k = next(regex for regex, name in _SPLITS.items() if name == "gpt-4o")
    _split_tokenizer(tmp_path / "tok.json", o200k)
    imported = _imported("llama", tmp_path / "tok.json", tmp_path)
    capsys.readouterr()
    export(imported, tmp_path / "m.gguf", "q8_0")
    assert "llama.cpp runs as an ASCII approximation" in capsys.readouterr().out
    fields = gguf_fields(tmp_path / "m.gguf")
    assert bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode() == "gpt-4o"
    llm = llama_cpp().Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=64, vocab_only=True, verbose=False)
    ours = Tokenizer.load(imported / "tokenizer.json")
    for text in ("The quick brown fox, it's 1234567 times!", "def f(x):\n    return x  # ok\n", "ЖЖ 你好"):
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ours.encode(text), text


def test_a_lora_sft_run_exports_merged_with_its_template(families, tmp_path):
    """A fine-tuned run: its adapters are merged into the GGUF's weights (logits equal lmforge's merged
    model) and the template it was trained with is in the metadata, the Modelfile and the stops."""
    from lmforge.checkpoint.runs import run_config
    from lmforge.data.instruct_tasks import generate, write_jsonl
    from lmforge.finetune.setup import load_merged

    imported, base = families("llama")
    write_jsonl(generate(None, 16, seed=1), tmp_path / "chat.jsonl")
    run = tmp_path / "run"
    sets = [f"run.dir={run}", f"model.init_from={imported}", "train.seq_len=64", "train.max_steps=2",
            "train.micro_batch_size=2", "train.eval_every=0", "train.precision=fp32", "train.threads=1",
            "checkpoint.every=0", "logging.progress=none", "finetune.method=lora", "optim.lr=0.05",
            f"sft.data=[{tmp_path / 'chat.jsonl'}]"]
    assert main(["sft", *[a for s in sets for a in ("--set", s)]]) == 0
    out = tmp_path / "sft.gguf"
    export(run, out, "f16")
    merged, _ = load_merged(*run_config(run))
    ids = random_ids(merged.cfg.vocab_size, (2, 24), seed=1)
    err = rel_error(merged, out, ids)
    assert err < TOLERANCE["f16"]
    assert err < rel_error(base, out, ids) / 5  # the file holds the merged model, not the base
    fields = gguf_fields(out)
    template = bytes(fields["tokenizer.chat_template"].parts[-1]).decode()
    assert "<|im_start|>" in template
    assert 'PARAMETER stop "<|im_end|>"' in (tmp_path / "sft.Modelfile").read_text()


@pytest.mark.parametrize("quant", ["f16", "q8_0"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_llama_cpp_loads_the_gguf_with_equal_logits_and_tokens(families, name, quant, tmp_path):
    """The optional tier: llama.cpp itself (llama-cpp-python) reads the file; its logits equal lmforge's
    within the weight type's tolerance and it tokenizes text to lmforge's ids."""
    llama_cpp()
    imported, ours = families(name)
    out = tmp_path / "model.gguf"
    export(imported, out, quant)
    llm = llama_cpp_model(out)
    tokenizer = Tokenizer.load(imported / "tokenizer.json")
    assert llm.tokenize(TEXT.encode(), add_bos=False, special=False) == tokenizer.encode(TEXT)
    err = llama_cpp_error(llm, ours, random_ids(ours.cfg.vocab_size, (40,)))
    print(f"llama.cpp {name} {quant}: max relative logit error {err:.2e}")
    assert err < TOLERANCE[quant], (name, quant, err)


def test_llama3_rope_scaling_is_written_as_llama_cpp_frequency_factors(tokenizer_file, tmp_path):
    """Llama 3.1's RoPE scaling has no metadata key in llama.cpp: it reads a `rope_freqs` tensor, each
    frequency's divisor. Those divisors are transformers' own Llama 3.1 frequencies over the plain ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    imported = _imported("llama", tokenizer_file, tmp_path, rope_parameters=scaling)
    export(imported, tmp_path / "m.gguf", "f16")
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    freqs = torch.from_numpy(np.array(tensors["rope_freqs.weight"].data, dtype=np.float32))
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    assert freqs.shape == (32,) and freqs.min() == 1.0 and freqs.max() == 8.0  # all three bands present
    assert torch.allclose(freqs, plain / scaled, rtol=1e-6, atol=0)
    # transformers still opens the file (it reads no RoPE scaling from a GGUF, so its logits would differ)
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf")
    # linear and yarn have metadata keys (llama.cpp computes yarn's attention factor itself, as transformers)
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32}
    for kind, params in (("linear", {"factor": 2.0}), ("yarn", yarn)):
        other = _imported("qwen2", tokenizer_file, tmp_path / kind,
                          rope_parameters={"rope_type": kind, "rope_theta": 10000.0, **params})
        export(other, tmp_path / f"{kind}.gguf", "f16")
        meta = gguf_fields(tmp_path / f"{kind}.gguf")
        assert bytes(meta["qwen2.rope.scaling.type"].parts[-1]).decode() == kind
        assert float(meta["qwen2.rope.scaling.factor"].parts[-1][0]) == params["factor"]
        if kind == "yarn":
            assert int(meta["qwen2.rope.scaling.original_context_length"].parts[-1][0]) == 32
    # a scaling llama.cpp has no form for is refused by name
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    other = _imported("llama", tokenizer_file, tmp_path / "dyn", rope_parameters=dynamic)
    assert main(["export", str(other), str(tmp_path / "d.gguf"), "--format", "gguf"]) == 2


def test_a_sliding_window_caps_the_context_length(tokenizer_file, tmp_path, capsys):
    """llama.cpp's llama attends to the whole context; that equals Mistral's sliding window only inside
    the window, so the file's context length is the window (logits equal there) and the export says so."""
    from lmforge.checkpoint.runs import load_model, run_config

    imported = _imported("mistral", tokenizer_file, tmp_path, sliding_window=16)
    capsys.readouterr()
    export(imported, tmp_path / "m.gguf", "f16")
    assert "context length is set to 16 (not 128)" in capsys.readouterr().out
    fields = gguf_fields(tmp_path / "m.gguf")
    assert int(fields["llama.context_length"].parts[-1][0]) == 16
    ours, _ = load_model(*run_config(imported))
    ids = random_ids(ours.cfg.vocab_size, (2, 16))
    assert rel_error(ours, tmp_path / "m.gguf", ids) < TOLERANCE["f16"]


def test_every_end_of_generation_id_becomes_a_stop(tokenizer_file, tmp_path):
    """Llama 3.1's files list three EOS ids (end of text, of a tool message, of a turn): all of them stop,
    the first is the file's EOS and the second its end of turn."""
    import json

    from lmforge.finetune.gguf_vocab import read_vocab

    (tmp_path / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    tok = Tokenizer.load(tokenizer_file)
    ids = [tok.token_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<|im_start|>")]
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    vocab = read_vocab(tmp_path, 320)
    assert (vocab.eos_id, vocab.eot_id, vocab.stop_ids) == (ids[0], ids[1], [ids[1], ids[0], ids[2]])
    assert len(vocab.tokens) == 320 and vocab.tokens[-1] == "[PAD319]" and vocab.types[-1] == 5  # UNUSED
    # an id past the vocabulary (e.g. a config's default EOS kept with a smaller tokenizer) is refused by key
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[0], 50279]}))
    with pytest.raises(LmforgeError, match="eos_token_id 50279 lies outside the vocabulary"):
        read_vocab(tmp_path, 320)


def _spm_encode(text: str, tokens: list[str], scores: list[float], types: list[int]) -> list[int]:
    """llama.cpp's SPM tokenizer, as its algorithm reads: spaces as U+2581 with one in front, then merge
    the adjacent pair whose joined text is a token of the highest score (leftmost on ties) until none is,
    and spell what is left outside the vocabulary as <0xNN> byte tokens."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (1, 4)}  # normal and user-defined tokens
    symbols = list("\u2581" + text.replace(" ", "\u2581"))
    while True:
        pairs = [(scores[ids[a + b]], -i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))
                 if a + b in ids]
        if not pairs:
            break
        i = -max(pairs)[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for sym in symbols:
        out += [ids[sym]] if sym in ids else [tokens.index(f"<0x{b:02X}>") for b in sym.encode()]
    return out


@pytest.mark.parametrize("layout", ["mistral", "llama2"])
def test_a_sentencepiece_style_tokenizer_round_trips(tmp_path, layout):
    """Written as llama.cpp's SPM vocabulary: scores that make its highest-score merge pick the pair BPE's
    lowest rank picks, byte and control token types, BOS added and the space prefix."""
    spm_tokenizer(tmp_path / "tok.json", layout)
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    imported = _imported("mistral", tmp_path / "tok.json", tmp_path, specials=specials)
    export(imported, tmp_path / "m.gguf", "q8_0")
    fields = gguf_fields(tmp_path / "m.gguf")
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "llama"
    assert bool(fields["tokenizer.ggml.add_bos_token"].parts[-1][0]) is True
    kinds = fields["tokenizer.ggml.token_type"]
    types = [int(kinds.parts[i][0]) for i in kinds.data]
    assert types[:4] == [2, 3, 3, 6] and types.count(6) == 256  # unknown, <s>, </s>, then the 256 bytes
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    ours = Tokenizer.load(imported / "tokenizer.json")
    vocab, ranks = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"]
    tokens = [bytes(vocab.parts[i]).decode() for i in vocab.data]
    scores = [float(ranks.parts[i][0]) for i in ranks.data]
    # words the vocabulary only has pieces of, where the order of merging decides the result
    rng = np.random.default_rng(0)
    jumble = " ".join("".join(rng.choice(list("thequickbrownfoxjumps"), size=rng.integers(3, 12)))
                      for _ in range(60))
    for text in (TEXT, "the quick brown fox 1234567", "two  inner spaces 🙂", jumble):
        assert _spm_encode(text, tokens, scores, types) == ours.encode(text), text
    # (no leading whitespace: there transformers' GGUF tokenizer, a Metaspace that adds no second U+2581,
    # differs from sentencepiece and llama.cpp, which always prefix one; Llama 2's layout does as they do)
    for text in (TEXT, "the quick brown fox", "two  inner spaces 🙂 and\n a newline"):
        assert theirs.encode(text, add_special_tokens=False) == ours.encode(text), text
