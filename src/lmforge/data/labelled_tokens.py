"""Tagged words (objective tag): CoNLL-like records -> a prepared data dir of token ids and
per-token labels, and the loader of its batches.

    {"tokens": ["Ada", "Lovelace", "wrote", "in", "London"], "tags": ["B-PER", "I-PER", "O", "O", "B-LOC"]}

(field names: token_classify.tokens_field / tags_field). Tags are names, or indices into
token_classify.label_names. The label map is label_names when given, else the training split's sorted
tag names (fixed when the data is prepared, saved as labels.json; the run dir keeps it).

Words become sub-word tokens as the sentence " ".join(words) would be tokenized word by word (each word
after the first with its leading space); a word's tag labels its FIRST sub-word token and its other
sub-words get -100, which the loss ignores: transformers' token-classification convention (its
run_ner's label_all_tokens=False). An encoder reads [CLS] words [SEP] ([CLS] and [SEP] also -100). Words
past train.seq_len are cut off (counted as truncated) and are not scored.

A bad record (words and tags of different lengths, a missing field, an unknown or out-of-range tag) stops
preparation with its file and line: a tagger trained around dropped tags is a different tagger.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.data.batch import IGNORE_INDEX, PaddedRows
from lmforge.data.chat import BadRow, ChatStats, iter_records
from lmforge.data.sources import check_source
from lmforge.data.task_data import Built, TaskLoader, prepare_dir, settings_of, split_records, tokenizer_file
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import DataError

KIND = "tagged"
MAX_WORDS = 10_000  # words of one record: a tagger reads seq_len tokens of them at most
MAX_WORD_CHARS = 1000
MAX_TAG_CHARS = 200  # a tag name: labels.json and an export's id2label hold each one


@dataclass(frozen=True)
class TaggedRecord:
    words: tuple[str, ...]
    tags: tuple[str | int, ...]
    where: str  # file:line


def parse_tagged(record: Any, where: str, c: Any) -> TaggedRecord:
    """One record's words and tags (`c`: the token_classify section), or DataError naming `where`."""
    if isinstance(record, BadRow):
        raise DataError(f"{where}: {record.why}")
    if not isinstance(record, dict):
        raise DataError(f"{where}: a tagged record must be a JSON object, got {type(record).__name__}")
    lists = []
    for key, name in ((c.tokens_field, "tokens_field"), (c.tags_field, "tags_field")):
        value = record.get(key)
        if hasattr(value, "tolist"):  # Parquet list columns arrive as numpy arrays
            value = value.tolist()
        if not isinstance(value, list) or not value:
            got = "missing" if key not in record else f"{type(value).__name__} {str(value)[:40]!r}"
            keys = ", ".join(sorted(map(str, record))[:8]) or "none"
            raise DataError(f"{where}: field {key!r} must be a non-empty list, got {got} (keys: {keys}); "
                            f"token_classify.{name} names it")
        if len(value) > MAX_WORDS:
            raise DataError(f"{where}: field {key!r} has {len(value):,} items (at most {MAX_WORDS:,})")
        lists.append(value)
    words, tags = lists
    if len(words) != len(tags):
        raise DataError(f"{where}: {len(words)} words ({c.tokens_field}) but {len(tags)} tags "
                        f"({c.tags_field}): give one tag per word")
    for i, w in enumerate(words):
        if not isinstance(w, str) or not w.strip() or len(w) > MAX_WORD_CHARS:
            raise DataError(f"{where}: word {i} {str(w)[:40]!r} must be a non-empty string of at most "
                            f"{MAX_WORD_CHARS} characters")
    out = []
    for i, t in enumerate(tags):
        if isinstance(t, float) and t.is_integer():
            t = int(t)
        if isinstance(t, bool) or not isinstance(t, (str, int)) or (isinstance(t, str) and
                                                                    not 0 < len(t) <= MAX_TAG_CHARS):
            raise DataError(f"{where}: tag {i} {str(t)[:40]!r} must be a tag name (1 to {MAX_TAG_CHARS} "
                            "characters) or an index into token_classify.label_names")
        out.append(t)
    return TaggedRecord(tuple(words), tuple(out), where)


def read_tagged(sources: list[str], c: Any) -> Iterator[TaggedRecord]:
    stats = ChatStats()
    for src in sources:
        check_source(src)
    for src in sources:
        for _, records in iter_records(Path(src), stats):
            for where, record in records:
                yield parse_tagged(record, where, c)


def tag_map(train: list[TaggedRecord], c: Any) -> list[str]:
    """The tags in index order: token_classify.label_names, or the training split's sorted names (at most
    num_labels of them; integer tags need label_names)."""
    if c.label_names:
        return list(c.label_names)
    seen: dict[str, str] = {}
    for r in train:
        for t in r.tags:
            if isinstance(t, int):
                raise DataError(f"{r.where}: tag {t} is an index; integer tags need token_classify."
                                "label_names (the tag names in index order)")
            if t not in seen:
                seen[t] = r.where
                if len(seen) > c.num_labels:
                    raise DataError(f"{r.where}: tag {t!r} is tag {len(seen)} of the training data, more "
                                    f"than token_classify.num_labels={c.num_labels}; raise num_labels or "
                                    "fix the tags")
    return sorted(seen)


def tag_indices(r: TaggedRecord, labels: list[str], index: dict[str, int]) -> list[int]:
    """The label index of each of a record's tags; DataError naming the record for one outside the map."""
    out = []
    for t in r.tags:
        if isinstance(t, int):
            if not 0 <= t < len(labels):
                raise DataError(f"{r.where}: tag {t} is out of range for the {len(labels)} tags of "
                                "token_classify.label_names")
            out.append(t)
        elif t in index:
            out.append(index[t])
        else:
            shown = ", ".join(map(repr, labels[:10])) + (", ..." if len(labels) > 10 else "")
            raise DataError(f"{r.where}: unknown tag {t!r}: the tags are {shown}")
    return out


def encode_words(tok: Tokenizer, r: TaggedRecord, tags: list[int], seq_len: int,
                 encoder: dict[str, int] | None) -> tuple[np.ndarray, np.ndarray, bool]:
    """(ids, labels, truncated): each word's sub-words with its tag on the first, -100 elsewhere."""
    pieces = tok.encode_batch([w if i == 0 else " " + w for i, w in enumerate(r.words)])
    room = seq_len - (2 if encoder else 0)
    ids, labels = ([encoder["cls"]], [IGNORE_INDEX]) if encoder else ([], [])
    cut = False
    for i, (p, t) in enumerate(zip(pieces, tags)):
        if not p:
            raise DataError(f"{r.where}: word {i} {r.words[i][:40]!r} encodes to no tokens")
        if len(ids) - (1 if encoder else 0) + len(p) > room:
            cut = True
            break
        ids += p
        labels += [t] + [IGNORE_INDEX] * (len(p) - 1)
    if encoder:
        ids.append(encoder["sep"])
        labels.append(IGNORE_INDEX)
    return np.asarray(ids, dtype=np.int32), np.asarray(labels, dtype=np.int64), cut


def _flat(encoded: list, k: int, dtype) -> np.ndarray:
    return np.concatenate([e[k] for e in encoded]).astype(dtype) if encoded else np.zeros(0, dtype)


def prepare(cfg: Any, console=print, replace: bool = False):
    """Prepare (or reuse) token_classify's tagged data in the run's data dir."""
    c = cfg.token_classify
    if not c.data:
        raise DataError("objective tag needs tagged records: set token_classify.data to .jsonl / "
                        ".parquet files (`lmforge tasks --tagged FILE` writes a shipped set)")
    tok_file = tokenizer_file(cfg, cfg.objective.name)
    tok = Tokenizer.load(tok_file)
    encoder = tok.encoder_ids() if cfg.model.arch == "encoder" else None
    if cfg.model.arch == "encoder" and encoder is None:
        raise DataError(f"{tok_file}: an encoder tags [CLS] words [SEP], and this tokenizer has no [CLS] / "
                        "[SEP] (or <s> / </s>): use the tokenizer of the encoder's own run")

    def build() -> Built:
        records = split_records(lambda paths: read_tagged(paths, c), c, "token_classify.data", cfg.run.seed)
        labels = tag_map(records["train"], c)
        index = {v: i for i, v in enumerate(labels)}
        splits, counts = {}, {}
        for name, recs in records.items():
            encoded = [encode_words(tok, r, tag_indices(r, labels, index), cfg.seq_len, encoder)
                       for r in recs]
            lengths = np.asarray([len(e[0]) for e in encoded], dtype=np.int64)
            splits[name] = {"ids": _flat(encoded, 0, np.int32), "labels": _flat(encoded, 1, np.int64),
                            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}
            counts[name] = {"examples": len(recs), "tokens": int(lengths.sum()),
                            "tagged words": int((splits[name]["labels"] != IGNORE_INDEX).sum()),
                            "truncated": sum(e[2] for e in encoded)}
        return Built(splits, counts, labels, {"num_labels": c.num_labels})

    prepared = prepare_dir(cfg, KIND, settings_of(c, cfg, tok_file, KIND), tok, build, console, replace)
    console("tag map (labels.json): " + ", ".join(f"{i}={v}" for i, v in enumerate(prepared.labels[:20])))
    return prepared


def name_hf_tags(hf_dir: Path, prepared: Path, num_labels: int) -> None:
    """An exported tagger's config.json with its tag map's names as id2label / label2id (LABEL_i for
    outputs the map does not name)."""
    from lmforge.utils.io import atomic_write_json

    tags = json.loads((prepared / "labels.json").read_text(encoding="utf-8"))
    names = [str(tags[i]) if i < len(tags) else f"LABEL_{i}" for i in range(num_labels)]
    path = hf_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(id2label={str(i): n for i, n in enumerate(names)},
                  label2id={n: i for i, n in enumerate(names)})
    atomic_write_json(path, config)


# -- batches ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaggedBatch(PaddedRows):
    """`input_ids` (B, T) right-padded, `lengths` (B,) each row's real tokens, `labels` (B, T): each word's
    tag index on its first sub-word token, -100 elsewhere (other sub-words, [CLS]/[SEP], padding)."""

    input_ids: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor
    real_tokens: int = 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TaggedBatch:
        return TaggedBatch(self.input_ids.to(device, non_blocking=non_blocking),
                           self.lengths.to(device, non_blocking=non_blocking),
                           self.labels.to(device, non_blocking=non_blocking), self.real_tokens)


class TaggedLoader(TaskLoader):
    kind = "TaggedLoader"

    def collate(self, rows: np.ndarray) -> TaggedBatch:
        lengths = np.asarray([int(self.split.lengths[int(i)]) for i in rows], dtype=np.int64)
        return TaggedBatch(torch.from_numpy(self.padded(rows, "ids", self.pad_id)), torch.from_numpy(lengths),
                           torch.from_numpy(self.padded(rows, "labels", IGNORE_INDEX)), int(lengths.sum()))
