"""A Hugging Face tokenizer dir as GGUF tokenizer metadata (`tokenizer.ggml.*` and the chat template).

llama.cpp rebuilds the tokenizer from these keys alone. A byte-level BPE (lmforge's own, GPT-2, Llama 3,
Qwen2/3) is written as `gpt2`: the vocabulary in id order, each token's type, the merges and a
pre-tokenizer *name* (llama.cpp has the split regexes built in and picks one by name), so it is written
only when its split regex is one llama.cpp knows by a name. A sentencepiece-style BPE with byte fallback
(Llama 2, Mistral) is written as `llama`: tokens, types and scores that make llama.cpp's
highest-score-first merging pick what the BPE's merge ranks pick. Anything else would tokenize
differently there, and is refused by name instead of written wrong."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.errors import LmforgeError

# llama.cpp's token types (gguf.TokenType): the values the file stores.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # sentencepiece's visible space

# Split regexes of the byte-level BPE tokenizers llama.cpp knows, by the pre-tokenizer name it files
# them under (`tokenizer.ggml.pre`). The text is compared exactly: a different regex is a different
# tokenizer, however similar it looks.
_SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "qwen2",
    # o200k (gpt-oss, Llama 4): llama.cpp names it gpt-4o and runs an approximation (see _APPROXIMATE)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+": "gpt-4o",
}
# Splits llama.cpp runs only approximately: what the export says. llama.cpp's own converter writes every
# o200k model this way; refusing would leave gpt-oss without a GGUF at all.
_APPROXIMATE = {
    "gpt-4o": "note: the tokenizer splits text with o200k's regex, which llama.cpp runs as an ASCII "
              "approximation (its gpt-4o pre-tokenizer, as in every gpt-oss GGUF): the same tokens on "
              "English, code, digits, CJK and Cyrillic, but words in non-ASCII capitals (\"ÉCOLE\"), "
              "titlecase digraphs and decomposed accents may split differently than in lmforge",
}
# Normalizers llama.cpp does not run but that change nothing a model's text holds in practice: Qwen2's
# NFC (llama.cpp's own Qwen2 conversion drops it the same way).
_HARMLESS_NORMALIZERS = {"NFC"}


@dataclass
class Vocab:
    """What goes into the GGUF's tokenizer keys."""

    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    pad_id: int | None
    add_bos: bool
    chat_template: str | None
    special: dict[str, int] = field(default_factory=dict)  # special token text -> id
    stop_ids: list[int] = field(default_factory=list)  # every token generation ends at (Modelfile stops)
    scores: list[float] | None = None  # a sentencepiece-style vocabulary: each token's merge priority
    add_space_prefix: bool = False
    notes: list[str] = field(default_factory=list)  # where llama.cpp tokenizes only approximately

    def write(self, writer) -> None:
        if self.scores is None:
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre(self.pre)
        else:  # llama.cpp's SPM tokenizer: merges the pair whose result scores highest
            writer.add_tokenizer_model("llama")
            writer.add_token_scores(self.scores)
            writer.add_add_space_prefix(self.add_space_prefix)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        writer.add_token_merges(self.merges)
        for add, value in ((writer.add_bos_token_id, self.bos_id), (writer.add_eos_token_id, self.eos_id),
                           (writer.add_eot_token_id, self.eot_id), (writer.add_pad_token_id, self.pad_id)):
            if value is not None:
                add(value)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(False)
        if self.chat_template is not None:
            writer.add_chat_template(self.chat_template)


def _pre_name(pre: dict[str, Any] | None, where: str) -> str:
    """llama.cpp's name for this pre-tokenizer, or LmforgeError naming what it is."""
    def byte_level(p: dict[str, Any], regex: bool) -> bool:
        return (p.get("type") == "ByteLevel" and not p.get("add_prefix_space", False)
                and bool(p.get("use_regex", True)) == regex)

    if pre is not None and byte_level(pre, True):
        return "gpt-2"  # GPT-2's own split regex, which ByteLevel applies itself
    parts = pre.get("pretokenizers", []) if pre is not None and pre.get("type") == "Sequence" else []
    if len(parts) == 2 and parts[0].get("type") == "Split" and byte_level(parts[1], False):
        regex = (parts[0].get("pattern") or {}).get("Regex")
        if parts[0].get("behavior") == "Isolated" and not parts[0].get("invert") and regex in _SPLITS:
            return _SPLITS[regex]
    raise LmforgeError(
        f"{where}: its pre_tokenizer {json.dumps(pre)[:300]} is not one llama.cpp knows by name; "
        "GGUF export writes byte-level BPE tokenizers that split text like GPT-2 (lmforge's own "
        "tokenizers), Llama 3, Qwen2 or o200k (gpt-oss), the splits llama.cpp knows"
    )


def _spm_layout(spec: dict[str, Any], label: str) -> bool:
    """Whether a sentencepiece-style tokenizer prefixes the text with a space (llama.cpp's
    add_space_prefix), for the two layouts its files come in; LmforgeError for any other, since llama.cpp
    only replaces spaces with U+2581 (and optionally prefixes one) and then merges the whole text."""
    norm, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    if pre is None and norm is not None:  # Llama 2's files: Prepend + Replace normalizers
        parts = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]
        if parts == [{"type": "Prepend", "prepend": SPACE}, replace]:
            return True
        if parts == [replace]:
            return False
    metaspace = pre is not None and pre.get("type") == "Metaspace" and pre.get("replacement") == SPACE
    if norm is None and metaspace and not pre.get("split", True):  # Mistral's: one Metaspace, whole text
        return pre.get("prepend_scheme", "always") != "never"
    raise LmforgeError(f"{label}: a sentencepiece-style tokenizer with normalizer {json.dumps(norm)[:200]} "
                       f"and pre_tokenizer {json.dumps(pre)[:200]}; GGUF export writes the layouts of "
                       "Llama 2's and Mistral's files (spaces as U+2581, no splitting), which llama.cpp "
                       "reproduces")


def _spm_scores(tokens: list[str], merges: list[str]) -> list[float]:
    """llama.cpp's SPM tokenizer merges, among adjacent pairs, the one whose result has the highest score;
    Hugging Face's BPE the pair of lowest merge rank. A result's score of minus the rank of its first merge
    makes the two pick the same pair. Tokens no merge makes (characters, bytes, specials) score below
    every merge: llama.cpp would join a pair into one of those only where nothing else joins."""
    rank: dict[str, int] = {}
    for r, merge in enumerate(merges):
        rank.setdefault(merge.replace(" ", "", 1), r)
    return [-float(rank.get(t, len(merges))) - 1.0 for t in tokens]


def _merges(model: dict[str, Any]) -> list[str]:
    # tokenizers writes merges as "a b" (older files) or as ["a", "b"] pairs (0.20 on)
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


def read_vocab(hf_dir: Path, n_vocab: int, label: str = "the tokenizer") -> Vocab:
    """The tokenizer of the Hugging Face dir `hf_dir` as GGUF metadata, padded to the model's
    `n_vocab` rows (a padded embedding's extra rows get unused placeholder tokens, as llama.cpp's
    converter writes them). LmforgeError for a tokenizer llama.cpp would not reproduce, naming it `label`
    (hf_dir is a scratch export: its path means nothing to the user)."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise LmforgeError(f"{label} has no tokenizer.json; GGUF export needs a fast (tokenizers) tokenizer")
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise LmforgeError(
            f"{label}: model type {model.get('type')!r} is not supported by GGUF export; it writes BPE "
            "tokenizers: byte-level (lmforge's own, GPT-2, Llama 3, Qwen2/3) and sentencepiece-style with "
            "byte fallback (Llama 2, Mistral)")
    spm = bool(model.get("byte_fallback"))
    pre, space_prefix = _split(spec, model, spm, label)
    tokens, types, special = _token_table(spec, model, n_vocab, label)
    merges = _merges(model)
    scores = None
    if spm:
        scores = _spm_scores(tokens, merges)
        for i, t in enumerate(tokens):
            if types[i] == NORMAL and re.fullmatch(r"<0x[0-9A-F]{2}>", t):
                types[i] = BYTE
        if model.get("unk_token") in model["vocab"]:
            types[model["vocab"][model["unk_token"]]] = UNKNOWN
    config = _json(hf_dir / "tokenizer_config.json")
    bos, eos, eot, pad, stops = _special_ids(hf_dir, config, special, n_vocab, label)
    add_bos, bos = _adds_bos(path, bos, label)
    return Vocab(pre=pre, tokens=tokens, types=types, merges=merges, bos_id=bos, eos_id=eos,
                 eot_id=eot, pad_id=pad, add_bos=add_bos, chat_template=_chat_template(hf_dir, config),
                 special=special, scores=scores, add_space_prefix=space_prefix,
                 stop_ids=list(dict.fromkeys(x for x in (eot, *stops, eos) if x is not None)),
                 notes=[_APPROXIMATE[pre]] if pre in _APPROXIMATE else [])


def _split(spec: dict[str, Any], model: dict[str, Any], spm: bool, label: str) -> tuple[str, bool]:
    """(llama.cpp's pre-tokenizer name, add_space_prefix) of the tokenizer, or LmforgeError where
    llama.cpp would split the text differently."""
    if spm:
        return "default", _spm_layout(spec, label)
    norm = spec.get("normalizer")
    if norm is not None and norm.get("type") not in _HARMLESS_NORMALIZERS:
        raise LmforgeError(f"{label}: normalizer {norm.get('type')!r} has no llama.cpp equivalent; GGUF "
                           "export supports tokenizers without a normalizer (or with NFC)")
    pre = _pre_name(spec.get("pre_tokenizer"), label)
    # llama.cpp looks a whole word up before merging (tokenizers' ignore_merges) for Llama 3's
    # vocabulary and only there; a tokenizer that differs would tokenize some words differently
    if bool(model.get("ignore_merges")) != (pre == "llama-bpe"):
        raise LmforgeError(f"{label}: ignore_merges={bool(model.get('ignore_merges'))} with a {pre} "
                           "split; llama.cpp uses ignore_merges exactly for Llama 3's split, so it would "
                           "tokenize some words differently")
    return pre, False


def _token_table(spec: dict[str, Any], model: dict[str, Any], n_vocab: int,
                 label: str) -> tuple[list[str], list[int], dict[str, int]]:
    """(tokens, types, special token text -> id) over the model's n_vocab rows: the vocabulary and the
    added tokens by id, rows no token names filled with unused placeholders."""
    tokens: list[str | None] = [None] * n_vocab
    types = [UNUSED] * n_vocab
    for text, i in model["vocab"].items():
        if i < n_vocab:
            tokens[i], types[i] = text, NORMAL
    special: dict[str, int] = {}
    for added in spec.get("added_tokens", []):
        i = added["id"]
        if i >= n_vocab:
            raise LmforgeError(f"{label}: added token {added['content']!r} has id {i}, beyond the model's "
                               f"{n_vocab} embedding rows")
        tokens[i] = added["content"]
        types[i] = CONTROL if added.get("special") else USER_DEFINED
        if added.get("special"):
            special[added["content"]] = i
    if sum(t is not None for t in tokens) < len(model["vocab"]):
        raise LmforgeError(f"{label}: the vocabulary has ids beyond the model's {n_vocab} embedding rows")
    return [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)], types, special


def _special_ids(hf_dir: Path, config: dict[str, Any], special: dict[str, int], n_vocab: int,
                 label: str) -> tuple[int | None, int | None, int | None, int | None, list[int]]:
    """(bos, eos, eot, pad, every eos id) from the model's config files, each within the vocabulary."""
    model_cfg, gen = _json(hf_dir / "config.json"), _json(hf_dir / "generation_config.json")

    def ids(key: str) -> list[int]:  # generation_config wins over config.json, as in transformers
        value = gen.get(key) if gen.get(key) is not None else model_cfg.get(key)
        return [int(v) for v in (value if isinstance(value, list) else [value] if value is not None else [])]

    # eos: what lmforge's export declares the model's end of text; eot: the end of a turn when that is
    # another token (the run's template's, or the tokenizer config's EOS, as a chat model's HF files set it)
    stops = ids("eos_token_id")
    named_eos = _token_id(config.get("eos_token"), special)
    eos = stops[0] if stops else named_eos
    eot = stops[1] if len(stops) > 1 else named_eos if named_eos != eos else None
    bos = (ids("bos_token_id") or [_token_id(config.get("bos_token"), special)])[0]
    pad = (ids("pad_token_id") or [_token_id(config.get("pad_token"), special)])[0]
    for key, values in (("bos_token_id", [bos]), ("eos_token_id", stops + [eos]), ("pad_token_id", [pad])):
        for v in values:
            if v is not None and not 0 <= v < n_vocab:
                raise LmforgeError(f"{label}: {key} {v} lies outside the vocabulary (0..{n_vocab - 1}); "
                                   "set the model config's special token ids to tokens the tokenizer has")
    return bos, eos, eot, pad, stops


def _adds_bos(path: Path, bos: int | None, label: str) -> tuple[bool, int | None]:
    """(whether the tokenizer itself puts a BOS before the text, the BOS id then), found by asking it
    (its post-processor); LmforgeError when it adds tokens after the text, which llama.cpp would not."""
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(path))
    plain = tok.encode("a", add_special_tokens=False).ids
    wrapped = tok.encode("a", add_special_tokens=True).ids
    add_bos = len(wrapped) > len(plain) and wrapped[1:] == plain
    if add_bos:
        bos = wrapped[0]
    if len(wrapped) > len(plain) and not add_bos:
        raise LmforgeError(f"{label}: the tokenizer adds special tokens after the text (e.g. an EOS), which "
                           "llama.cpp would not do; GGUF export supports adding a BOS only")
    return add_bos, bos


def _chat_template(hf_dir: Path, config: dict[str, Any]) -> str | None:
    """The chat template of the tokenizer config (its default one of several), or of chat_template.jinja."""
    template = config.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").is_file():
        template = (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_id(token: Any, special: dict[str, int]) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return special.get(token) if isinstance(token, str) else None
