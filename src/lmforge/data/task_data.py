"""Prepared data of the understanding tasks beside sequence classification: tagged words (objective
tag, data/labelled_tokens.py) and SQuAD-like questions (objective qa, data/squad.py).

What they share: the prepared dir in the run's data dir (arrays per split as .npy, the tokenizer,
labels.json and meta.json written last, built in a sibling and renamed into place, reused while its
fingerprint matches, as data/labelled.py does for a classifier), the object the build's chat path reads
(a tokenizer, no template, its splits), and a loader over examples of right-padded rows with the seeded,
exactly resumable order of `EpochSampler`. `prepare_task_data` / `load_task_data` pick the kind by the
method's facts (its data kind) or by the dir's meta.
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.data.prepare import TOKENIZER_FILE, data_dir, split_of
from lmforge.data.sampler import EpochSampler
from lmforge.data.shards import read_meta, write_meta
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import DataError

LABELS_FILE = "labels.json"
FORMAT = 1
# a method's data kind (config/methods.py) -> the module that prepares and batches it
MODULES = {"tagged": "lmforge.data.labelled_tokens", "spans": "lmforge.data.squad",
           "text2text": "lmforge.data.seq2seq_data"}


def task_kinds() -> tuple[str, ...]:
    return tuple(MODULES)


def prepare_task_data(cfg: Any, console: Callable[[str], object] = print, replace: bool = False):
    """Prepare (or reuse) the data of the run's method (its facts' data kind) in the run's data dir."""
    from lmforge.config.methods import method_facts

    return importlib.import_module(MODULES[method_facts(cfg).data]).prepare(cfg, console, replace)


def load_task_data(dir: str | Path) -> PreparedTask:
    dir = Path(dir)
    meta = read_meta(dir)
    if meta is None or meta.get("kind") not in MODULES:
        raise DataError(f"{dir} holds no prepared tagged or question-answering data")
    return PreparedTask(dir, Tokenizer.load(dir / TOKENIZER_FILE, eos_id=meta["eos_id"]), meta)


@dataclass
class TaskSplit:
    """One split's arrays (`offsets` (examples + 1,) int64 into the flat per-token arrays, and the rest)."""

    arrays: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.arrays["offsets"]) - 1

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.__dict__["arrays"][name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.arrays["offsets"])

    def rows(self, name: str, i: int) -> np.ndarray:
        """Example i's slice of the flat per-token array `name`."""
        o = self.arrays["offsets"]
        return self.arrays[name][int(o[i]): int(o[i + 1])]


@dataclass
class PreparedTask:
    """A prepared dir as the build's chat path reads prepared data: a tokenizer, no chat template, no
    added tokens, and its splits."""

    dir: Path
    tokenizer: Tokenizer
    meta: dict
    template: None = None

    @property
    def labels(self) -> list:
        return list(self.meta["labels"])

    def split(self, name: str) -> TaskSplit:
        if name not in self.meta["splits"]:
            raise DataError(f"unknown split {name!r}; valid splits: {', '.join(self.meta['splits'])}")
        return TaskSplit({a: np.load(self.dir / f"{name}_{a}.npy", allow_pickle=False, mmap_mode="r")
                          for a in self.meta["arrays"]})

    def info(self, name: str) -> None:
        return None


def tokenizer_file(cfg: Any, what: str) -> Path:
    if not cfg.data.tokenizer.path:
        raise DataError(f"objective {what} needs the tokenizer of the model it fine-tunes: set "
                        "model.init_from (its tokenizer is used) or data.tokenizer.path")
    path = Path(cfg.data.tokenizer.path)
    return path / TOKENIZER_FILE if path.is_dir() else path


def settings_of(section: Any, cfg: Any, tok_file: Path, kind: str) -> dict:
    """What the prepared dir depends on: the section's settings, the files' sizes and times, seq_len, the
    seed and the tokenizer's bytes."""
    files = []
    for src in [*section.data, *section.val_data]:
        p = Path(src)
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                st = f.stat()
                files.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return {"format": FORMAT, "kind": kind, "section": section.model_dump(mode="json"),
            "seq_len": cfg.seq_len, "seed": cfg.run.seed,
            "tokenizer": hashlib.sha256(tok_file.read_bytes()).hexdigest(),
            "files": files}


@dataclass
class Built:
    """What a kind's builder returns: per split its arrays and counts, and the label map."""

    splits: dict[str, dict[str, np.ndarray]]
    counts: dict[str, dict[str, int]]
    labels: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # more of the meta (a kind's own facts)
    files: dict[str, str] = field(default_factory=dict)  # more files of the dir: name -> text


def split_records(read: Callable[[list[str]], Iterable[Any]], section: Any, key: str, seed: int
                  ) -> dict[str, list]:
    """A task section's {"train", "val"} records: its `val_data`, or the `val_fraction` of its `data` that
    `split_of` sends to validation by the seed and position; DataError naming `key` (its data key) when no
    training record is left. `read(paths)` yields the records of those files."""
    out: dict[str, list] = {"train": [], "val": []}
    if section.val_data:
        out["train"], out["val"] = list(read(section.data)), list(read(section.val_data))
    else:
        for i, r in enumerate(read(section.data)):
            out[split_of(i, seed, section.val_fraction) if section.val_fraction > 0 else "train"].append(r)
    if not out["train"]:
        raise DataError(f"{key} holds no training records ({', '.join(section.data)})")
    return out


def prepare_dir(cfg: Any, kind: str, settings: dict, tok: Tokenizer, build: Callable[[], Built],
                console: Callable[[str], object], replace: bool) -> PreparedTask:
    """Reuse the run's data dir if it holds this preparation, else build it beside and swap it in. A dir
    with other data is refused unless `replace` (a fresh run's own dir, prepared with other settings)."""
    out = data_dir(cfg)
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    if out.exists():
        meta = read_meta(out)
        if meta is not None and meta.get("fingerprint") == fingerprint and meta.get("kind") == kind:
            console(f"reusing prepared {kind} data in {out}")
            return load_task_data(out)
        stale = replace and meta is not None and meta.get("kind") == kind
        if not stale and (meta is not None or any(out.iterdir())):
            raise DataError(f"data dir {out} holds other data (prepared with other settings or for another "
                            "method); choose another data.dir or delete it to prepare again")
    built = build()  # before anything is written: bad records leave the data dir as it was
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{kind}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tok.save(tmp / TOKENIZER_FILE)
        names = sorted(next(iter(built.splits.values())))
        for split, arrays in built.splits.items():
            for name, arr in arrays.items():
                np.save(tmp / f"{split}_{name}.npy", arr, allow_pickle=False)
        (tmp / LABELS_FILE).write_text(json.dumps(built.labels), encoding="utf-8")
        for name, text in built.files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        meta = {"kind": kind, "format": FORMAT, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                "base_vocab": tok.vocab_size, "added_tokens": [], "labels": built.labels, "arrays": names,
                "splits": built.counts, **built.extra, "fingerprint": fingerprint, "settings": settings}
        write_meta(tmp, meta)
        old = out.with_name(f".{out.name}.old-{kind}-{os.getpid()}")
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for name, counts in built.counts.items():
        console(f"{kind} {name}: " + ", ".join(f"{v:,} {k}" for k, v in counts.items()))
    return load_task_data(out)


class TaskLoader(abc.ABC):
    """Batches of one split, an example per row, in the seeded epoch order of `EpochSampler` (rank r of W
    takes every W-th example); Stateful and resumable exactly, as LabelledLoader. A kind's loader gives
    `collate`."""

    kind = "TaskLoader"

    def __init__(self, split: TaskSplit, seq_len: int, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, drop_last: bool = True, pad_id: int = 0) -> None:
        self.split, self.seq_len, self.pad_id = split, seq_len, pad_id
        if len(split) and int(split.lengths.max()) > seq_len:
            raise DataError(f"an example has {int(split.lengths.max())} tokens, more than seq_len={seq_len}: "
                            "the data was prepared for a longer train.seq_len; prepare it again")
        need = world_size * (batch_size if drop_last else 1)
        if len(split) < need:
            raise DataError(f"the split has {len(split):,} examples; batch_size={batch_size} on world_size="
                            f"{world_size} needs at least {need}: use more data or a smaller batch")
        self.sampler = EpochSampler(len(split), batch_size, seed=seed, rank=rank, world_size=world_size,
                                    shuffle=shuffle, drop_last=drop_last, kind=self.kind,
                                    count_key="examples", settings={"seq_len": seq_len})
        self.batches_per_epoch = self.sampler.batches_per_epoch

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def next_batch(self):
        return self.collate(self.sampler.next_units())

    def __iter__(self) -> Iterator:
        while True:
            yield self.next_batch()

    def iter_eval_batches(self, max_batches: int | None = None) -> Iterator:
        """One sequential pass over this rank's examples; the loader's state is untouched."""
        for units in self.sampler.eval_units(max_batches):
            yield self.collate(units)

    def padded(self, rows: np.ndarray, name: str, fill: int) -> np.ndarray:
        """The examples `rows` of the flat per-token array `name`, right-padded with `fill`: (B, T) int64."""
        lengths = [int(self.split.lengths[int(i)]) for i in rows]
        out = np.full((len(rows), max(lengths)), fill, dtype=np.int64)
        for r, i in enumerate(rows):
            out[r, : lengths[r]] = self.split.rows(name, int(i))
        return out

    @abc.abstractmethod
    def collate(self, rows: np.ndarray):
        """The batch of the examples `rows`."""

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.sampler.load_state_dict(sd)
