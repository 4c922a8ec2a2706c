"""Tokenizers on top of Hugging Face `tokenizers`: train, load, save, encode, decode.

Three kinds train (`data.tokenizer.kind`): a byte-level BPE (GPT-2 style, the default), a WordPiece
(BERT's cased normalisation and pre-tokenisation, [UNK] for a word it cannot spell) and a Unigram
(SentencePiece-style: spaces as "▁", byte fallback, so no text is unknown). Any tokenizer.json loads.

Text never produces control tokens: a document that literally contains "<|endoftext|>" is encoded
as ordinary text, so only the data pipeline decides where documents end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import numpy as np
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from lmforge.errors import DataError
from lmforge.utils.io import atomic_write_text
from lmforge.utils.jsontext import loads

EOS_TOKEN = "<|endoftext|>"
KINDS = ("bpe", "wordpiece", "unigram")  # what Tokenizer.train makes (data.tokenizer.kind)
KIND_NAMES = {"bpe": "byte-level BPE", "wordpiece": "WordPiece", "unigram": "Unigram"}  # in messages
UNK_TOKENS = {"wordpiece": "[UNK]", "unigram": "<unk>"}  # id 1 of those kinds (id 0 is EOS_TOKEN)
# A Unigram's pieces that text must never produce (the control tokens, the byte-fallback "<0xNN>") keep
# this score: the Viterbi path then always takes the characters' own pieces (or their bytes) instead,
# as SentencePiece does by excluding them from matching.
_NEVER = -1e9
# End-of-document tokens of common tokenizer families, tried in this order when loading one.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
# What a masked-LM encoder frames and corrupts sequences with, as (cls, sep, mask, pad): BERT's names, or
# RoBERTa's. lmforge's own tokenizers get BERT's appended (after the BPE ids, which stay as they are).
ENCODER_TOKEN_SETS = (("[CLS]", "[SEP]", "[MASK]", "[PAD]"), ("<s>", "</s>", "<mask>", "<pad>"))
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")
TEXT_SLACK = 64  # tokens of margin in text_budget: a cut inside a word changes only its last tokens


@lru_cache(maxsize=1)
def byte_level_decoder_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> the byte it represents."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:  # bytes without a printable glyph are shifted past 255
            chars[chr(256 + n)] = b
            n += 1
    return chars


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the end-of-document id the data pipeline needs."""

    def __init__(self, tok: HFTokenizer, eos_id: int):
        self._tok = tok
        self._tok.encode_special_tokens = True  # see the module docstring
        self.eos_id = eos_id
        self._longest: int | None = None  # characters of the longest vocabulary entry (text_budget)

    @property
    def hf(self) -> HFTokenizer:
        """The wrapped `tokenizers.Tokenizer` (for export)."""
        return self._tok

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
              kind: str = "bpe") -> Tokenizer:
        """Train a tokenizer of `kind` (KINDS) whose first id is the EOS token: a byte-level BPE (every
        byte in the vocab), a WordPiece or a Unigram with byte fallback (see the module docstring).
        `min_frequency` is the BPE's and WordPiece's least pair count for a merge; a Unigram prunes by
        likelihood and has none."""
        if kind == "wordpiece":
            return cls._train_wordpiece(texts, vocab_size, min_frequency)
        if kind == "unigram":
            return cls._train_unigram(texts, vocab_size)
        if kind != "bpe":
            raise DataError(f"tokenizer kind {kind!r} is not one lmforge trains; give one of "
                            f"{', '.join(KINDS)}")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[EOS_TOKEN],
            # all 256 bytes up front, so any text round-trips even if the training text never had it
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok, tok.token_to_id(EOS_TOKEN))

    @classmethod
    def _train_wordpiece(cls, texts: Iterable[str], vocab_size: int, min_frequency: int) -> Tokenizer:
        """BERT-cased style: control characters dropped, whitespace and punctuation split words (and are
        gone from the ids: decoding puts one space between words), "##" marks a word's later pieces, and
        a word with a character the vocabulary lacks is one [UNK]."""
        tok = HFTokenizer(models.WordPiece(unk_token=UNK_TOKENS["wordpiece"]))
        tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                    strip_accents=False, lowercase=False)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            special_tokens=[EOS_TOKEN, UNK_TOKENS["wordpiece"]],
                                            show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok, tok.token_to_id(EOS_TOKEN))

    @classmethod
    def _train_unigram(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        """SentencePiece style: a space is "▁" and a run of them starts the next word (never prepended,
        so decoding gives the text back exactly; a run stays one word, as SentencePiece's
        allow_whitespace_only_pieces, so code's indentation is a piece, not a token per space: 3.2 bytes
        per token on held-out stdlib code against 1.9 split at each space), other whitespace characters are
        pieces of their own (so a long document cut before whitespace encodes as it would whole:
        prepare._pieces), and the 256 byte tokens "<0x00>".."<0xFF>" (the last ids) spell any character
        the vocabulary lacks."""
        unk = UNK_TOKENS["unigram"]
        tok = HFTokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"[\t\n\r\f\v]"), "isolated"),
            pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=False),
            pre_tokenizers.Split(Regex("\u2581+"), "merged_with_next")])
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
        # Every character of the never-matched pieces is a piece of its own: a character the vocabulary
        # lacked would get an unknown node scored below _NEVER, and the lattice would then take the whole
        # piece ("<0x41>" read as "A").
        spelled = sorted(set(EOS_TOKEN + unk + "<0x0123456789ABCDEF>"))
        # the byte tokens come on top of what the trainer learns, within vocab_size
        trainer = trainers.UnigramTrainer(vocab_size=max(vocab_size - 256, 3),
                                          special_tokens=[EOS_TOKEN, unk], unk_token=unk,
                                          initial_alphabet=spelled, show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        model = json.loads(tok.to_str())["model"]
        controls = {EOS_TOKEN, unk}
        vocab = [(p, _NEVER if p in controls else score) for p, score in model["vocab"]]
        have = {p for p, _ in vocab}
        if missing := [c for c in spelled if c not in have]:  # the trainer keeps its alphabet; if it did not
            low = min((score for p, score in vocab if p not in controls), default=0.0)
            vocab += [(c, low) for c in missing]
        vocab += [(b, _NEVER) for b in (f"<0x{i:02X}>" for i in range(256)) if b not in have]
        tok.model = models.Unigram(vocab, model["unk_id"], True)
        return cls(tok, tok.token_to_id(EOS_TOKEN))

    @classmethod
    def load(cls, path: str | Path, eos_id: int | None = None) -> Tokenizer:
        """Load any tokenizer.json (or a folder holding one).

        The EOS is `eos_id` when given, else the first known end token in the vocabulary, else the
        eos_token of a tokenizer_config.json next to the file.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist; give the path of a tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for every parse error
            raise DataError(f"{path} is not a valid tokenizer.json: {e}") from None
        if eos_id is not None:
            return cls(tok, eos_id)
        return cls(tok, _find_eos(tok, path, path.parent / "tokenizer_config.json"))

    @classmethod
    def of(cls, tokenizer: Tokenizer | HFTokenizer | str | Path | object) -> Tokenizer:
        """An lmforge Tokenizer from one, from a `tokenizers.Tokenizer`, from a tokenizer.json path, or
        from a transformers fast tokenizer (its `backend_tokenizer` and `eos_token_id`)."""
        if isinstance(tokenizer, Tokenizer):
            return tokenizer
        if isinstance(tokenizer, (str, Path)):
            return cls.load(tokenizer)
        if isinstance(tokenizer, HFTokenizer):
            return cls(tokenizer, _find_eos(tokenizer, "the tokenizer"))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if isinstance(backend, HFTokenizer):
            eos = getattr(tokenizer, "eos_token_id", None)
            return cls(backend, eos if isinstance(eos, int) else _find_eos(backend, "the tokenizer"))
        raise DataError(f"tokenizer: expected an lmforge Tokenizer, a tokenizers.Tokenizer, a path to a "
                        f"tokenizer.json or a transformers fast tokenizer, got {type(tokenizer).__name__}")

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json atomically."""
        atomic_write_text(path, self._tok.to_str(pretty=True))

    def save_hf(self, out_dir: str | Path, model_max_length: int, chat_template: str | None = None) -> None:
        """Write tokenizer.json + tokenizer_config.json that `transformers.AutoTokenizer` loads."""
        out_dir = Path(out_dir)
        self.save(out_dir / "tokenizer.json")
        eos = self._tok.id_to_token(self.eos_id)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": eos,
            "bos_token": eos,  # GPT-2 convention: one end-of-text token separates documents
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
        }
        if (unk := self._unk_token()) is not None:  # WordPiece's, Unigram's (a BPE's config is as it was)
            config["unk_token"] = unk
        if chat_template is not None:
            config["chat_template"] = chat_template
        if (enc := self.encoder_ids()) is not None:  # what transformers' fill-mask pipeline looks for
            config.update({f"{k}_token": self._tok.id_to_token(i) for k, i in enc.items()})
        atomic_write_text(out_dir / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added."""
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except TypeError:
            raise _not_unicode([text]) from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by the Rust side."""
        try:
            return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]
        except TypeError:
            raise _not_unicode(texts) from None

    def text_budget(self, n_tokens: int) -> int:
        """Characters of text that hold more than `n_tokens` tokens, however the text goes on: a token
        covers at most as many characters as its vocabulary entry has (bytes, for a byte-level BPE), so
        this many characters hold n_tokens + TEXT_SLACK tokens, the slack being margin for a cut that
        lands inside a word. Renders and tokenization cut text here, so a record far longer than the
        sequence costs what a sequence costs. (A normalizer that deletes characters, or a WordPiece's [UNK]
        standing for a whole long word, could make the text hold fewer; its first tokens are still the
        text's first tokens.)"""
        if self._longest is None:
            self._longest = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        return (n_tokens + TEXT_SLACK) * max(self._longest, 1)

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets of a rendered chat: here special tokens written in the text (the
        template's `<|im_start|>`...) ARE special tokens, as transformers' apply_chat_template encodes
        them. Message contents are checked for special-token text before rendering (`special_tokens`)."""
        self._tok.encode_special_tokens = False
        try:
            enc = self._tok.encode(text, add_special_tokens=False)
        except TypeError:
            raise _not_unicode([text]) from None
        finally:
            self._tok.encode_special_tokens = True
        return enc.ids, enc.offsets

    def special_tokens(self) -> list[str]:
        """The text of every special (added, control) token."""
        return [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]

    def add_special_tokens(self, tokens: Iterable[str]) -> list[int]:
        """Add control tokens the vocabulary lacks (a chat template's); returns the ids of all `tokens`."""
        from tokenizers import AddedToken

        missing = [t for t in tokens if self._tok.token_to_id(t) is None]
        if missing:
            self._longest = None
            self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        return [self._tok.token_to_id(t) for t in tokens]

    def encoder_ids(self) -> dict[str, int] | None:
        """{"cls", "sep", "mask", "pad": id} of the first complete ENCODER_TOKEN_SETS entry, else None."""
        for names in ENCODER_TOKEN_SETS:
            ids = [self._tok.token_to_id(n) for n in names]
            if all(i is not None for i in ids):
                return dict(zip(("cls", "sep", "mask", "pad"), ids))
        return None

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens are kept so that decode(encode(s)) == s."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (one more than the largest id)."""
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        return max(self._tok.get_vocab_size(with_added_tokens=True), max(ids) + 1)

    def token_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes each id stands for (int64, one entry per id; special tokens 0), for bits per byte.

        A token's bytes are those of the text it decodes to, so the ids of a text sum to the text's bytes:
        exactly for byte-level BPE, and for SentencePiece-style vocabularies ("▁" counts as a space,
        "<0xNN>" byte-fallback tokens as one byte; a literal "▁" in the text, which they cannot tell from
        a space, counts 1 byte where it had 3). A WordPiece drops whitespace and "##" only marks a later
        piece of a word, so its ids sum to the bytes of the normalised text without whitespace, and an
        [UNK] (special) counts 0 (the docs' tokenize page states it).
        """
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        added = self._tok.get_added_tokens_decoder()
        byte_map = byte_level_decoder_map() if self._is_byte_level() else None
        prefix = self._tok.model.continuing_subword_prefix if self.model_type == "WordPiece" else None
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i in added:  # added tokens are stored as plain text, not in the model's alphabet
                lengths[i] = 0 if added[i].special else len(added[i].content.encode("utf-8"))
            elif byte_map is not None and all(c in byte_map for c in token):
                lengths[i] = len(token)  # one stand-in character per byte
            elif _BYTE_FALLBACK.fullmatch(token):
                lengths[i] = 1
            elif prefix and token.startswith(prefix) and len(token) > len(prefix):
                lengths[i] = len(token[len(prefix):].encode("utf-8"))
            else:
                lengths[i] = len(token.replace("\u2581", " ").encode("utf-8"))
        return lengths

    def _unk_token(self) -> str | None:
        """The unknown token of a WordPiece or Unigram model, else None."""
        if self.model_type not in ("WordPiece", "Unigram"):
            return None
        return None if self.unk_id is None else self._tok.id_to_token(self.unk_id)

    @property
    def unk_id(self) -> int | None:
        """The id the model gives what it cannot encode (WordPiece's [UNK], a Unigram's unk_id, a BPE's
        unk_token), None when it has none (a byte-level BPE encodes everything)."""
        if self.model_type == "Unigram":
            return json.loads(self._tok.to_str())["model"].get("unk_id")
        unk = getattr(self._tok.model, "unk_token", None)
        return None if unk is None else self._tok.token_to_id(unk)

    @property
    def model_type(self) -> str:
        """The model's algorithm as tokenizer.json names it: "BPE", "WordPiece", "Unigram" or "WordLevel"."""
        return type(self._tok.model).__name__

    def _is_byte_level(self) -> bool:
        dec = json.loads(self._tok.to_str()).get("decoder") or {}
        parts = dec.get("decoders", [dec]) if dec.get("type") == "Sequence" else [dec]
        return any(d.get("type") == "ByteLevel" for d in parts)


def _find_eos(tok: HFTokenizer, where: str | Path, config: Path | None = None) -> int:
    """The first known end token in the vocabulary, else the eos_token of a tokenizer_config.json."""
    for name in EOS_CANDIDATES:
        if tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    name = _config_eos(config) if config is not None else None
    if name is not None and tok.token_to_id(name) is not None:
        return tok.token_to_id(name)
    looked = f" and for eos_token in {config}" if config is not None else ""
    raise DataError(
        f"{where}: no end-of-document token found (looked for {', '.join(EOS_CANDIDATES)}{looked}); "
        "add one of them to the tokenizer"
    )


def _config_eos(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:  # BadJSON is a ValueError: nested too deeply, lone surrogates
        eos = loads(path.read_bytes().decode("utf-8-sig")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):  # transformers also writes {"content": "...", ...}
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def _not_unicode(texts: list) -> Exception:
    """The error for text `tokenizers` refuses: a lone surrogate (U+D800-U+DFFF) is not Unicode text
    and cannot be encoded; anything else is a caller's bug, passed on as the TypeError it is."""
    for text in texts:
        if isinstance(text, str):
            at = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
            if at is not None:
                return DataError(
                    f"the text holds a lone surrogate ({text[at]!r} at character {at}), which is not valid "
                    "Unicode: an unpaired \\ud800-\\udfff escape in JSON, or bytes that are not UTF-8; "
                    "fix the text"
                )
    return TypeError("tokenizers accepts text (str) only")
