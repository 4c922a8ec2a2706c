"""Labelled records (objective classify) -> a prepared data dir of token ids, labels and the label map,
and the loader of its batches.

Records are GLUE's shapes, the field names the classify section's:

  {"sentence": "...", "label": "positive"}                       one text
  {"sentence1": "...", "sentence2": "...", "label": 1}            a pair (text_pair_field): joined by "\\n"

A classifier's labels are class names (strings) or indices (integers), never a mix. Names are mapped to
indices by the sorted names of the training split (the map is fixed once, when the data is prepared, and
saved as labels.json beside the arrays: the run dir holds it); indices are their own map, 0..num_labels-1.
A regressor's (num_labels=1) label is a finite number. A bad record (a missing field, an unknown or
out-of-range label, a regression label that is not a number) stops preparation with its file and line:
a classifier trained around silently dropped labels is a different classifier.

The prepared dir holds, per split, ids (int32, back to back), offsets (int64) and labels (int64 classes
or float32 numbers) as .npy files, the tokenizer, labels.json and meta.json (written last), in a sibling
renamed into place and reused while its fingerprint matches, like the chat data of `prepare_sft`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.data.batch import PaddedRows
from lmforge.data.chat import BadRow, ChatStats, iter_records
from lmforge.data.prepare import TOKENIZER_FILE, data_dir, split_of
from lmforge.data.sampler import EpochSampler
from lmforge.data.shards import read_meta, write_meta
from lmforge.data.sources import check_source
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import DataError

KIND = "labelled"  # the kind of the prepared dir, in its meta
FORMAT = 1
LABELS_FILE = "labels.json"
SPLITS = ("train", "val")
MAX_TEXT_CHARS = 1 << 20  # one record's text: a classifier reads seq_len tokens of it at most
MAX_LABEL_CHARS = 200  # a class name: the label map (labels.json, an export's id2label) holds each one


@dataclass(frozen=True)
class LabelledRecord:
    texts: tuple[str, ...]  # the text, or a pair's two
    label: Any  # str | int (a class) or float (regression), as the record gave it
    where: str  # file:line

    @property
    def text(self) -> str:
        """What a decoder reads: the texts joined by a newline."""
        return "\n".join(self.texts)


def parse_record(record: Any, where: str, fields: Any, regression: bool) -> LabelledRecord:
    """One record's text and label (`fields`: the classify section), or DataError naming `where`."""
    if isinstance(record, BadRow):
        raise DataError(f"{where}: {record.why}")
    if not isinstance(record, dict):
        raise DataError(f"{where}: a labelled record must be a JSON object, got {type(record).__name__}")
    names = [fields.text_field] + ([fields.text_pair_field] if fields.text_pair_field else [])
    texts = []
    for name in names:
        value = record.get(name)
        if not isinstance(value, str) or not value.strip():
            got = "missing" if name not in record else f"{type(value).__name__} {str(value)[:40]!r}"
            keys = ", ".join(sorted(map(str, record))[:8]) or "none"
            raise DataError(f"{where}: field {name!r} must be a non-empty string, got {got} (keys: {keys}); "
                            "classify.text_field / text_pair_field name the text fields")
        if len(value) > MAX_TEXT_CHARS:
            raise DataError(f"{where}: field {name!r} has {len(value):,} characters (at most "
                            f"{MAX_TEXT_CHARS:,})")
        texts.append(value)
    if fields.label_field not in record or record[fields.label_field] is None:
        raise DataError(f"{where}: the label field {fields.label_field!r} is missing (classify.label_field "
                        "names it)")
    label = record[fields.label_field]
    if isinstance(label, bool):
        raise DataError(f"{where}: label {label!r} is a boolean; give a class name, a class index or (for "
                        "regression) a number")
    if regression:
        if not isinstance(label, (int, float)) or not math.isfinite(label):
            raise DataError(f"{where}: label {label!r} is not a finite number; classify.num_labels=1 is "
                            "regression, whose labels are numbers")
        label = float(label)
    elif isinstance(label, float) and label.is_integer():
        label = int(label)  # Parquet and pandas write integer columns with missing values as floats
    elif not isinstance(label, (str, int)):
        raise DataError(f"{where}: label {str(label)[:40]!r} is a {type(label).__name__}; a class is a name "
                        "(string) or an index (integer); for regression set classify.num_labels=1")
    elif isinstance(label, str) and not 0 < len(label) <= MAX_LABEL_CHARS:
        raise DataError(f"{where}: label {label[:40]!r} has {len(label):,} characters; a class name has 1 to "
                        f"{MAX_LABEL_CHARS}")
    return LabelledRecord(tuple(texts), label, where)


def read_labelled(sources: list[str], fields: Any, regression: bool,
                  stats: ChatStats | None = None) -> Iterator[LabelledRecord]:
    """Every record of `sources` (.jsonl / .parquet files, folders of them, a saved `datasets` dir)."""
    stats = stats if stats is not None else ChatStats()
    for src in sources:
        check_source(src)
    for src in sources:
        for _, records in iter_records(Path(src), stats):
            for where, record in records:
                stats.records += 1
                yield parse_record(record, where, fields, regression)


def label_map(train: list[LabelledRecord], num_labels: int) -> list[str | int]:
    """The classes in index order: the training split's sorted names, or 0..num_labels-1 for indices.
    Refuses a mix of both, an index out of range and more names than num_labels (naming the record)."""
    if not train:
        return []
    kinds = {type(r.label) for r in train}
    if len(kinds) > 1:
        first = next(r for r in train if not isinstance(r.label, type(train[0].label)))
        raise DataError(f"{first.where}: label {first.label!r} mixes class indices and class names (the "
                        f"first record, {train[0].where}, has {train[0].label!r}); use one or the other")
    if kinds == {int}:
        for r in train:
            if not 0 <= r.label < num_labels:
                raise DataError(f"{r.where}: label {r.label} is out of range for classify.num_labels="
                                f"{num_labels} (class indices 0..{num_labels - 1})")
        return list(range(num_labels))
    seen: dict[str, str] = {}
    for r in train:
        if r.label not in seen:
            seen[r.label] = r.where
            if len(seen) > num_labels:
                raise DataError(f"{r.where}: label {r.label!r} is class {len(seen)} of the training data, "
                                f"more than classify.num_labels={num_labels}; raise num_labels or fix the "
                                "labels")
    return sorted(seen)


def label_index(record: LabelledRecord, labels: list[str | int], index: dict) -> int:
    """The class index of a record's label; DataError naming the record for one the map does not hold."""
    key = record.label
    if isinstance(key, int) and labels and isinstance(labels[0], int):
        if not 0 <= key < len(labels):
            raise DataError(f"{record.where}: label {key} is out of range for classify.num_labels="
                            f"{len(labels)} (class indices 0..{len(labels) - 1})")
        return key
    if key not in index:
        shown = ", ".join(map(repr, labels[:10])) + (", ..." if len(labels) > 10 else "")
        raise DataError(f"{record.where}: unknown label {key!r}: the training data's labels are {shown}")
    return index[key]


# -- the prepared dir ---------------------------------------------------------------------------------
@dataclass
class LabelledSplit:
    ids: np.ndarray  # int32, the examples back to back
    offsets: np.ndarray  # int64 (examples + 1,)
    labels: np.ndarray  # int64 class indices, or float32 regression targets
    second: np.ndarray  # int64: where each example's second segment starts (its length without one)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def example(self, i: int) -> np.ndarray:
        return self.ids[int(self.offsets[i]): int(self.offsets[i + 1])]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass
class PreparedLabelled:
    """A prepared labelled dir: what the build's chat path asks of prepared data (a tokenizer, no chat
    template, no added tokens) and its splits."""

    dir: Path
    tokenizer: Tokenizer
    meta: dict
    template: None = None  # a classifier renders no chat template

    @property
    def labels(self) -> list[str | int]:
        return list(self.meta["labels"])

    def split(self, name: str) -> LabelledSplit:
        if name not in self.meta["splits"]:
            raise DataError(f"unknown split {name!r}; valid splits: {', '.join(self.meta['splits'])}")
        arrays = [np.load(self.dir / f"{name}_{part}.npy", allow_pickle=False, mmap_mode="r")
                  for part in ("ids", "offsets", "labels", "second")]
        return LabelledSplit(*arrays)

    def info(self, name: str) -> None:
        return None


def load_prepared_labelled(dir: str | Path) -> PreparedLabelled:
    dir = Path(dir)
    meta = read_meta(dir)
    if meta is None or meta.get("kind") != KIND:
        raise DataError(f"{dir} holds no prepared labelled data (meta.json kind {KIND!r})")
    return PreparedLabelled(dir, Tokenizer.load(dir / TOKENIZER_FILE, eos_id=meta["eos_id"]), meta)


def _settings(cfg: Any, tok_file: Path) -> dict:
    c = cfg.classify
    files = []
    for src in [*c.data, *c.val_data]:
        p = Path(src)
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                st = f.stat()
                files.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return {"format": FORMAT, "kind": KIND, "data": list(c.data), "val_data": list(c.val_data),
            "val_fraction": c.val_fraction, "num_labels": c.num_labels, "text_field": c.text_field,
            "text_pair_field": c.text_pair_field, "label_field": c.label_field, "seq_len": cfg.seq_len,
            "seed": cfg.run.seed, "tokenizer": hashlib.sha256(tok_file.read_bytes()).hexdigest(),
            "files": files}


def prepare_labelled(cfg: Any, console: Callable[[str], object] = print,
                     replace: bool = False) -> PreparedLabelled:
    """Prepare (or reuse) the classify section's labelled data in the run's data dir. `replace`: an
    earlier preparation there with other settings is the run's own and is prepared again."""
    c = cfg.classify
    if not c.data:
        raise DataError("objective classify needs labelled records: set classify.data to .jsonl / .parquet "
                        "files (`lmforge tasks --labelled DIR` writes a shipped set)")
    if not cfg.data.tokenizer.path:
        raise DataError("objective classify needs the tokenizer of the model it fine-tunes: set "
                        "model.init_from (its tokenizer is used) or data.tokenizer.path")
    tok_path = Path(cfg.data.tokenizer.path)
    if tok_path.is_dir():
        tok_path = tok_path / TOKENIZER_FILE
    out = data_dir(cfg)
    settings = _settings(cfg, tok_path)
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    stale = False
    if out.exists():
        meta = read_meta(out)
        if meta is not None and meta.get("fingerprint") == fingerprint and meta.get("kind") == KIND:
            console(f"reusing prepared labelled data in {out}")
            return load_prepared_labelled(out)
        stale = replace and meta is not None and meta.get("kind") == KIND
        if not stale and (meta is not None or any(out.iterdir())):
            raise DataError(f"data dir {out} holds other data (prepared with other settings or for another "
                            "method); choose another data.dir or delete it to prepare again")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-labelled-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        meta = _build(cfg, tok_path, tmp)
        meta.update(fingerprint=fingerprint, settings=settings)
        write_meta(tmp, meta)
        old = out.with_name(f".{out.name}.old-labelled-{os.getpid()}")
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for name, sp in meta["splits"].items():
        console(f"labelled {name}: {sp['examples']:,} examples, {sp['tokens']:,} tokens")
    if meta["labels"]:
        shown = ", ".join(f"{i}={v}" for i, v in enumerate(meta["labels"][:20]))
        console(f"label map ({LABELS_FILE}): {shown}")
    return load_prepared_labelled(out)


def encode(tok: Tokenizer, records: list[LabelledRecord], seq_len: int,
           encoder: dict[str, int] | None) -> tuple[list[np.ndarray], list[int], int]:
    """(ids per record, where each one's second segment starts, how many were cut to seq_len). A decoder
    reads the joined text (its start when too long); an encoder BERT's [CLS] a [SEP] (b [SEP]), the
    longer text trimmed first until it fits (transformers' longest_first truncation)."""
    out, seconds, cut = [], [], 0
    if encoder is None:
        for e in tok.encode_batch([r.text for r in records]) if records else []:
            cut += len(e) > seq_len
            out.append(np.asarray(e[:seq_len], dtype=np.int32))
            seconds.append(len(out[-1]))
        return out, seconds, cut
    cls, sep = encoder["cls"], encoder["sep"]
    for r in records:
        parts = [tok.encode(t) for t in r.texts]
        room = seq_len - 1 - len(parts)  # [CLS] and a [SEP] after each text
        cut += sum(map(len, parts)) > room
        while sum(map(len, parts)) > max(room, 0):
            longest = max(range(len(parts)), key=lambda i: len(parts[i]))
            parts[longest] = parts[longest][:-1]
        first = [cls, *parts[0], sep]
        rest = [t for p in parts[1:] for t in (*p, sep)]
        out.append(np.asarray(first + rest, dtype=np.int32))
        seconds.append(len(first) if rest else len(out[-1]))
    return out, seconds, cut


def _build(cfg: Any, tok_path: Path, dir: Path) -> dict:
    c = cfg.classify
    regression = c.num_labels == 1
    tok = Tokenizer.load(tok_path)
    encoder = tok.encoder_ids() if cfg.model.arch == "encoder" else None
    if cfg.model.arch == "encoder" and encoder is None:
        raise DataError(f"{tok_path}: an encoder classifies [CLS] text [SEP], and this tokenizer has no "
                        "[CLS] / [SEP] (or <s> / </s>): use the tokenizer of the encoder's own run")
    records: dict[str, list[LabelledRecord]] = {"train": [], "val": []}
    if c.val_data:
        records["train"] = list(read_labelled(c.data, c, regression))
        records["val"] = list(read_labelled(c.val_data, c, regression))
    else:
        for i, r in enumerate(read_labelled(c.data, c, regression)):
            records[split_of(i, cfg.run.seed, c.val_fraction) if c.val_fraction > 0 else "train"].append(r)
    if not records["train"]:
        raise DataError(f"classify.data holds no training records ({', '.join(c.data)})")
    labels = [] if regression else label_map(records["train"], c.num_labels)
    index = {v: i for i, v in enumerate(labels)}
    tok.save(dir / TOKENIZER_FILE)
    splits = {}
    for name, recs in records.items():
        ids, seconds, cut = encode(tok, recs, cfg.seq_len, encoder)
        for r, e in zip(recs, ids):
            if not len(e):
                raise DataError(f"{r.where}: the text encodes to no tokens")
        if regression:
            y = np.asarray([r.label for r in recs], dtype=np.float32)
        else:
            y = np.asarray([label_index(r, labels, index) for r in recs], dtype=np.int64)
        lengths = np.asarray([len(e) for e in ids], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = np.concatenate(ids) if ids else np.zeros(0, np.int32)
        second = np.asarray(seconds, dtype=np.int64)
        for part, arr in (("ids", flat), ("offsets", offsets), ("labels", y), ("second", second)):
            np.save(dir / f"{name}_{part}.npy", arr, allow_pickle=False)
        splits[name] = {"examples": len(recs), "tokens": int(offsets[-1]), "truncated": cut}
    (dir / LABELS_FILE).write_text(json.dumps(labels), encoding="utf-8")
    return {"kind": KIND, "format": FORMAT, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "base_vocab": tok.vocab_size, "added_tokens": [], "num_labels": c.num_labels, "labels": labels,
            "splits": splits}


def name_hf_labels(hf_dir: Path, prepared: Path, num_labels: int) -> None:
    """An exported classifier's config.json with its label map's names as id2label / label2id and
    transformers' problem_type (regression for one output, so that its loss is the MSE trained here)."""
    from lmforge.utils.io import atomic_write_json

    labels = json.loads((prepared / LABELS_FILE).read_text(encoding="utf-8")) if num_labels > 1 else []
    path = hf_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    names = [str(v) for v in labels] if len(set(map(str, labels))) == num_labels else \
        [f"LABEL_{i}" for i in range(num_labels)]
    config.update(id2label={str(i): n for i, n in enumerate(names)},
                  label2id={n: i for i, n in enumerate(names)},
                  problem_type="regression" if num_labels == 1 else "single_label_classification")
    atomic_write_json(path, config)


# -- batches ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LabelledBatch(PaddedRows):
    """`input_ids` (B, T) right-padded, `lengths` (B,) each row's real tokens, `labels` (B,): class
    indices (int64) or regression targets (float32); `token_types` (B, T): 1 on a pair's second segment
    (an encoder's token-type ids), else 0."""

    input_ids: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor
    real_tokens: int = 0
    token_types: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LabelledBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return LabelledBatch(move(self.input_ids), move(self.lengths), move(self.labels), self.real_tokens,
                             move(self.token_types))

    @property
    def examples(self) -> int:
        return self.labels.numel()


class LabelledLoader:
    """`LabelledBatch`es of one split, an example per row, in the seeded epoch order of `EpochSampler`
    (rank r of W takes every W-th example); Stateful and resumable exactly, as ChatLoader."""

    def __init__(self, split: LabelledSplit, seq_len: int, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, drop_last: bool = True, pad_id: int = 0) -> None:
        self.split, self.seq_len, self.pad_id = split, seq_len, pad_id
        if len(split) and int(split.lengths.max()) > seq_len:
            raise DataError(f"an example has {int(split.lengths.max())} tokens, more than seq_len={seq_len}: "
                            "the data was prepared for a longer train.seq_len; prepare it again")
        need = world_size * (batch_size if drop_last else 1)
        if len(split) < need:
            raise DataError(f"the split has {len(split):,} labelled examples; batch_size={batch_size} on "
                            f"world_size={world_size} needs at least {need}: use more data or a smaller "
                            "batch")
        self.sampler = EpochSampler(len(split), batch_size, seed=seed, rank=rank, world_size=world_size,
                                    shuffle=shuffle, drop_last=drop_last, kind="LabelledLoader",
                                    count_key="examples", settings={"seq_len": seq_len})
        self.batches_per_epoch = self.sampler.batches_per_epoch

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def next_batch(self) -> LabelledBatch:
        return self.collate(self.sampler.next_units())

    def __iter__(self) -> Iterator[LabelledBatch]:
        while True:
            yield self.next_batch()

    def iter_eval_batches(self, max_batches: int | None = None) -> Iterator[LabelledBatch]:
        """One sequential pass over this rank's examples; the loader's state is untouched."""
        for units in self.sampler.eval_units(max_batches):
            yield self.collate(units)

    def collate(self, rows: np.ndarray) -> LabelledBatch:
        lengths = np.asarray([int(self.split.lengths[int(i)]) for i in rows], dtype=np.int64)
        ids = np.full((len(rows), int(lengths.max())), self.pad_id, dtype=np.int64)
        for r, i in enumerate(rows):
            ids[r, : lengths[r]] = self.split.example(int(i))
        labels = torch.from_numpy(np.asarray([self.split.labels[int(i)] for i in rows]))
        second = np.asarray([int(self.split.second[int(i)]) for i in rows], dtype=np.int64)
        pos = np.arange(ids.shape[1])[None]
        types = ((pos >= second[:, None]) & (pos < lengths[:, None])).astype(np.int64)
        return LabelledBatch(torch.from_numpy(ids), torch.from_numpy(lengths), labels, int(lengths.sum()),
                             torch.from_numpy(types))

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.sampler.load_state_dict(sd)
