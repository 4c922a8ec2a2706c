"""`prepare(cfg)`: sources -> train/val split -> tokenizer -> token shards -> meta.json.

The work happens in a temporary sibling of the data dir that is renamed into place at the end, and
meta.json is the last file written: a data dir either holds complete prepared data or does not exist.
A data dir is reused when its fingerprint (a hash of every setting that decides its content) matches.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge._version import __version__
from lmforge.config.methods import method_facts
from lmforge.config.schema import Config, DataConfig
from lmforge.data.encode_pool import ChunkEncoder, resolve_workers
from lmforge.data.seq2seq import add_sentinels
from lmforge.data.shards import ShardWriter, dtype_for_vocab, read_meta, write_meta
from lmforge.data.sources import (
    BUILTIN_PYTHON,
    SourceStats,
    Spread,
    builtin_python_identity,
    check_source,
    iter_documents,
    walk_files,
)
from lmforge.data.tokenizer import ENCODER_TOKEN_SETS, KIND_NAMES, Tokenizer
from lmforge.errors import DataError

FORMAT = 1  # bump when the layout of a prepared dir changes, so old dirs are not silently reused
SPLITS = ("train", "val")
TOKENIZER_FILE = "tokenizer.json"
_BATCH_DOCS = 1000  # documents per encode_batch call
_BATCH_CHARS = 16_000_000  # ... or fewer, so a chunk of huge documents stays small in memory
# `tokenizers` needs ~110 bytes of memory per character of one string it encodes (~90 to train on it),
# so a 20 MB document encoded whole took 3.6 GB, a 60 MB one 9.4 GB. A document longer than
# _LONG_DOC_CHARS is therefore encoded, and fed to the tokenizer trainer, in pieces of at most
# _PIECE_CHARS characters whose ids are concatenated. Shorter documents are encoded whole, exactly as
# before: the longest file of the stdlib (the golden corpus) has 229k chars, and a source file or an
# article is far shorter still.
_LONG_DOC_CHARS = 1_000_000
# Small pieces: the trainer works on as many at once as there are cores, and its time grows with the
# square of the length of a run without whitespace (5 MB with no space took 90 s in 100k-char pieces,
# 7 s in these, and more than 10 minutes whole).
_PIECE_CHARS = 10_000
_CUT_WINDOW = 1_000  # a cut moves back at most this far to reach whitespace; else it is a hard cut
# One encode call holds every piece's encoding until it returns: 4M chars of pieces per call take
# ~450 MB, as much as a normal batch of _BATCH_CHARS, and keep the cores busy.
_CALL_CHARS = 4_000_000
# A cut goes before an ASCII whitespace character that follows a non-space (Python's \s covers every
# character the pre-tokenizer's \s does, so its \S errs on the safe side): byte-level pre-tokenizers
# (GPT-2's regex) always end a pre-token there and look only ahead, so a byte-level BPE gives the very
# ids it would give the whole document. Matched on the reversed window, so the first match is the last.
_CUT_REVERSED = re.compile(r"[ \t\n\r\f\v](?=\S)")


@dataclass
class PreparedData:
    """A prepared data dir: its tokenizer, its meta.json and its shard files."""

    dir: Path
    tokenizer: Tokenizer
    meta: dict

    def shards(self, split: str) -> list[Path]:
        """Shard files of `split` ("train" or "val"), in stream order."""
        return [self.dir / name for name in self._split(split)["shards"]]

    def source_shards(self) -> dict[str, list[Path]]:
        """Each source's train shard files when the data was prepared as a weighted mixture, else {}."""
        return {e["name"]: [self.dir / f for f in e["shards"]]
                for e in self._split("train").get("sources", [])}

    def num_tokens(self, split: str) -> int:
        """Tokens in `split`, EOS tokens included."""
        return int(self._split(split)["tokens"])

    def _split(self, split: str) -> dict:
        if split not in self.meta["splits"]:
            raise DataError(f"unknown split {split!r}; valid splits: {', '.join(self.meta['splits'])}")
        entry = self.meta["splits"][split]
        if not isinstance(entry, dict) or not {"shards", "tokens"} <= set(entry):
            # a fine-tuning run's data dir (examples, not token shards) has a meta.json of its own
            raise DataError(f"{self.dir} holds no token shards of the {split} split (it is not a "
                            "pretraining data dir)")
        return entry


def data_dir(cfg: Config) -> Path:
    """Where `cfg`'s prepared data lives: data.dir, else <run.dir>/data."""
    return Path(cfg.data.dir) if cfg.data.dir else Path(cfg.run.dir) / "data"


def load_prepared(dir: str | Path) -> PreparedData:
    """Open a data dir written by `prepare` (no config needed)."""
    dir = Path(dir)
    meta = read_meta(dir)
    if meta is None:
        raise DataError(f"{dir} holds no prepared data (no meta.json); run `lmforge prepare` first")
    tok = Tokenizer.load(dir / TOKENIZER_FILE, eos_id=meta["eos_id"])
    return PreparedData(dir, tok, meta)


def split_of(index: int, seed: int, val_fraction: float) -> str:
    """The split ("train" or "val") of document number `index`: a seeded hash, stable and streamable.

    Documents 0 and 1 go to val and train, so that any corpus of two or more documents has both.
    """
    if index < 2:
        return SPLITS[1 - index]
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return "val" if int.from_bytes(digest, "little") < val_fraction * 2.0**64 else "train"


def prepare(cfg: Config, console: Callable[[str], object] = print) -> PreparedData:
    """Prepare (or reuse) the token shards and tokenizer that `cfg` describes."""
    t0 = time.perf_counter()
    out = data_dir(cfg)
    settings = _settings(cfg)
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    existing = _existing(out, settings, fingerprint)
    if existing is not None:
        console(f"reusing prepared data in {out}")
        return existing
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(out)
    tmp = out.with_name(f"{_tmp_prefix(out)}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        meta = _build(cfg, tmp, console)
        meta.update(fingerprint=fingerprint, settings=settings, seconds=round(time.perf_counter() - t0, 2))
        write_meta(tmp, meta)
        try:
            os.rename(tmp, out)  # replaces an empty dir; fails if another process published first
        except OSError:
            other = _existing(out, settings, fingerprint)
            if other is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            console(f"reusing prepared data in {out} (written by another process meanwhile)")
            return other
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _print_summary(meta, out, console)
    return load_prepared(out)


def check_reusable(cfg: Config) -> None:
    """DataError now when data.dir holds data prepared with other settings: a run checks this before
    run.overwrite replaces its old run dir, so a refused run leaves the old run as it was."""
    settings = _settings(cfg)
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    _existing(data_dir(cfg), settings, fingerprint)


def _build(cfg: Config, dir: Path, console: Callable[[str], object]) -> dict:
    d, seed = cfg.data, cfg.run.seed
    if d.tokenizer.path:
        tok = Tokenizer.load(d.tokenizer.path)
        how = f"loaded {d.tokenizer.path}"
    else:
        console(f"training a {KIND_NAMES[d.tokenizer.kind]} (vocab {d.tokenizer.vocab_size:,}) on up to "
                f"{d.tokenizer.train_chars:,} chars of the train documents")
        pass_stats, fed = SourceStats(), [0]
        tok = Tokenizer.train(_train_texts(d, seed, pass_stats, fed), d.tokenizer.vocab_size,
                              d.tokenizer.min_frequency, d.tokenizer.kind)
        if fed[0] == 0:  # no train document means the pass read the whole corpus
            raise _too_small(d, pass_stats)
        how = f"trained on {fed[0]:,} chars"
    if cfg.model.arch == "encoder" and tok.encoder_ids() is None:
        # Appended after the BPE's ids, which stay as they are: the shards equal a decoder's.
        tok.add_special_tokens(ENCODER_TOKEN_SETS[0])
        how += f", {' '.join(ENCODER_TOKEN_SETS[0])} added"
    if missing := [t for t in method_facts(cfg).tokens if tok.token_id(t) is None]:
        tok.add_special_tokens(missing)  # the method's own (GLM's blanks), appended like the encoder's
        how += f", {' '.join(missing)} added"
    if cfg.model.arch == "t5":  # T5's sentinels, after every other id (span corruption's <extra_id_k>)
        how += add_sentinels(tok)
    tok.save(dir / TOKENIZER_FILE)

    dtype = dtype_for_vocab(tok.vocab_size)
    writers = {s: ShardWriter(dir, s, dtype, d.shard_tokens) for s in SPLITS}
    # A weighted mixture keeps each source's train documents in shards of their own (train-<name>_*),
    # so the loader can draw from each at its weight; the val split stays one stream.
    mix = [f"train-{name}" for name, _ in d.mixture or []]
    writers.update({m: ShardWriter(dir, m, dtype, d.shard_tokens) for m in mix})
    stats = SourceStats()
    chunk: list[tuple[str, str]] = []
    chars = 0
    enc = ChunkEncoder(tok, dir / TOKENIZER_FILE, resolve_workers(d.workers),
                       lambda s, ids: writers[s].add(ids))
    try:
        for _, split, doc in _split_documents(d, seed, stats):
            if mix and split == "train":
                split = mix[len(stats.sources) - 1]  # the source being read
            if len(doc) > _LONG_DOC_CHARS:
                enc.submit(chunk)  # first the documents before it, to keep the order
                enc.drain()
                chunk, chars = [], 0
                writers[split].add(_encode_long(tok, doc))
                continue
            chunk.append((split, doc))
            chars += len(doc)
            if len(chunk) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                enc.submit(chunk)
                chunk, chars = [], 0
        enc.submit(chunk)
        enc.close()
    finally:
        enc.terminate()
    files = {s: w.close() for s, w in writers.items()}
    if mix:
        return _mixture_meta(d, tok, dtype, how, stats, writers, files)
    if writers["train"].num_docs == 0 or writers["val"].num_docs == 0:
        raise _too_small(d, stats)
    return {
        "format": FORMAT,
        "lmforge_version": __version__,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": dtype.name,
        "tokenizer": {"file": TOKENIZER_FILE, "how": how},
        "splits": {s: {"tokens": w.num_tokens, "documents": w.num_docs, "shards": files[s]}
                   for s, w in writers.items()},
        "stats": stats.to_dict(),
    }


def _mixture_meta(d: DataConfig, tok: Tokenizer, dtype: np.dtype, how: str, stats: SourceStats,
                  writers: dict[str, ShardWriter], files: dict[str, list[str]]) -> dict:
    """meta.json of a mixture: the train split lists every source's shards (in source order, so a reader
    of plain train shards sees the whole corpus) and, under "sources", each source's own."""
    parts = [(name, writers[f"train-{name}"], files[f"train-{name}"]) for name, _ in d.mixture or []]
    empty = [name for name, w, _ in parts if w.num_docs == 0]
    if empty or writers["val"].num_docs == 0:
        if stats.documents < 2 or not empty:
            raise _too_small(d, stats)
        raise DataError(f"data.sources entry {empty[0]!r} has no training documents ({stats.summary()}); "
                        "a mixture needs text in every source: give it more text or remove it")
    return {
        "format": FORMAT, "lmforge_version": __version__, "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id, "dtype": dtype.name, "tokenizer": {"file": TOKENIZER_FILE, "how": how},
        "splits": {
            "train": {"tokens": sum(w.num_tokens for _, w, _ in parts),
                      "documents": sum(w.num_docs for _, w, _ in parts),
                      "shards": [f for _, _, fs in parts for f in fs],
                      "sources": [{"name": n, "tokens": w.num_tokens, "documents": w.num_docs, "shards": fs}
                                  for n, w, fs in parts]},
            "val": {"tokens": writers["val"].num_tokens, "documents": writers["val"].num_docs,
                    "shards": files["val"]},
        },
        "stats": stats.to_dict(),
    }


def _split_documents(d: DataConfig, seed: int, stats: SourceStats) -> Iterator[tuple[int, str, str]]:
    """(index, split, text) of every document: data.sources split by a hash of the index and the seed
    (val_fraction of them held out), or, with data.val_sources, data.sources all train and
    data.val_sources all validation."""
    if not d.val_sources:
        for i, doc in enumerate(iter_documents(d, stats)):
            yield i, split_of(i, seed, d.val_fraction), doc
        return
    for src in d.val_sources:  # a bad path fails before the train sources are read
        check_source(src)
    for i, doc in enumerate(iter_documents(d, stats)):
        yield i, "train", doc
    # data.max_chars bounds the validation text on its own: counted on top of the train text read so far,
    # else a train corpus that reached the limit would leave the validation split empty
    room = None if d.max_chars is None else stats.chars + d.max_chars
    val = d.model_copy(update={"sources": list(d.val_sources), "max_chars": room})
    for i, doc in enumerate(iter_documents(val, stats)):
        yield i, "val", doc


def _train_texts(d: DataConfig, seed: int, stats: SourceStats, fed: list[int]) -> Iterator[str]:
    """The train documents, cut off after tokenizer.train_chars characters; `fed[0]` counts them."""
    budget = d.tokenizer.train_chars
    # max_chars_from=spread: the sample spread over the documents read too, not their first train_chars
    keep = Spread(budget / d.max_chars) if d.max_chars_from == "spread" and d.max_chars else None
    for i, doc in enumerate(iter_documents(d, stats)):
        if not d.val_sources and split_of(i, seed, d.val_fraction) != "train":
            continue  # the tokenizer must not see validation text, or val loss would flatter it
        if keep is not None and not keep(len(doc)):
            continue
        doc = doc[: budget - fed[0]]
        fed[0] += len(doc)
        if len(doc) > _LONG_DOC_CHARS:
            yield from _pieces(doc)  # the trainer's word counts, hence the tokenizer, stay the same
        else:
            yield doc
        if fed[0] >= budget:
            return


def _encode_long(tok: Tokenizer, doc: str) -> np.ndarray:
    """Ids of a document longer than _LONG_DOC_CHARS, EOS included, encoded some pieces at a time."""
    parts = []
    it = _pieces(doc)
    while batch := list(itertools.islice(it, _CALL_CHARS // _PIECE_CHARS)):
        # uint32 holds any id (vocab_size <= 1M) in 4 bytes; a Python list would take ~36 per id
        parts.extend(np.asarray(ids, dtype=np.uint32) for ids in tok.encode_batch(batch))
    parts.append(np.asarray([tok.eos_id], dtype=np.uint32))
    return np.concatenate(parts)


def _pieces(text: str) -> Iterator[str]:
    """`text` in consecutive pieces of at most _PIECE_CHARS characters.

    Each cut is the last one within _CUT_WINDOW characters before the limit that falls before a
    whitespace character following a non-space (see _CUT_REVERSED); when that window has none, the
    cut is at the limit.
    """
    start = 0
    while len(text) - start > _PIECE_CHARS:
        limit = start + _PIECE_CHARS
        lo = max(start + 1, limit - _CUT_WINDOW)
        m = _CUT_REVERSED.search(text[lo:limit + 1][::-1])
        cut = limit - m.start() if m else limit
        yield text[start:cut]
        start = cut
    yield text[start:]


def _too_small(d: DataConfig, stats: SourceStats) -> DataError:
    if stats.documents == 0:
        return DataError(f"no documents found in data.sources {d.source_paths}: {stats.summary()}; "
                         "point data.sources at .txt/.md/.jsonl files or folders with text in them")
    return DataError(f"corpus too small: {stats.documents} documents ({stats.summary()}); "
                     "need at least 2 documents so that train and val each get one")


# ---- fingerprint and existing dirs -------------------------------------------------------------------


def _settings(cfg: Config) -> dict:
    """Every setting that decides what a prepared dir holds (its sha256 is the fingerprint)."""
    d = cfg.data
    tok = d.tokenizer
    if tok.path:
        tok_id: dict = {"path": str(Path(tok.path).resolve()), "sha256": _file_sha256(Path(tok.path))}
    else:
        tok_id = {"vocab_size": tok.vocab_size, "min_frequency": tok.min_frequency,
                  "train_chars": tok.train_chars,
                  **({"kind": tok.kind} if tok.kind != "bpe" else {})}  # a BPE's fingerprint is as it was
    return {
        "format": FORMAT,
        "sources": [_source_identity(s) for s in d.source_paths],
        "text_key": d.text_key,
        "val_fraction": d.val_fraction,
        "max_chars": d.max_chars,
        "tokenizer": tok_id,
        "seed": cfg.run.seed,
        "on_bad_utf8": d.on_bad_utf8,
        "on_bad_json": d.on_bad_json,
        "shard_tokens": d.shard_tokens,
        # only when set: data prepared before the key existed keeps its fingerprint
        **({"val_sources": [_source_identity(s) for s in d.val_sources]} if d.val_sources else {}),
        **({"max_chars_from": d.max_chars_from} if d.max_chars_from != "start" else {}),
        **({"encoder_tokens": True} if cfg.model.arch == "encoder" else {}),
        **({"method_tokens": list(method_facts(cfg).tokens)} if method_facts(cfg).tokens else {}),
        **({"t5_sentinels": True} if cfg.model.arch == "t5" else {}),
        # a mixture's shards are per source; its weights are read at load time and change nothing here
        **({"mixture": [name for name, _ in d.mixture]} if d.mixture else {}),
    }


def _source_identity(src: str) -> dict:
    """Resolved path + total size + newest mtime: changes when the text a source holds changes."""
    if src == BUILTIN_PYTHON:
        return builtin_python_identity()
    check_source(src)
    path = Path(src)
    files = list(walk_files(path)) if path.is_dir() else [path]
    st = [_stat(f) for f in files]
    return {"source": src, "path": str(path.resolve()), "files": len(files),
            "bytes": sum(s.st_size for s in st), "mtime_ns": max((s.st_mtime_ns for s in st), default=0)}


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as e:  # removed (or its folder made unreadable) since the walk listed it
        raise DataError(f"cannot read {path} ({e.strerror}); make it a readable file or move it out of "
                        "data.sources") from None


def _file_sha256(path: Path) -> str:
    if not path.is_file():
        raise DataError(f"data.tokenizer.path {path} does not exist; give the path of a tokenizer.json")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _existing(out: Path, settings: dict, fingerprint: str) -> PreparedData | None:
    """The prepared data in `out` if it matches; None if there is none; DataError if it differs."""
    if not out.exists():
        return None
    meta = read_meta(out)
    if meta is None:
        if out.is_dir() and not any(out.iterdir()):
            return None
        raise DataError(f"data dir {out} exists but holds no meta.json, so it is not prepared data; "
                        "delete it or choose another data.dir")
    if meta.get("fingerprint") == fingerprint:
        return load_prepared(out)
    old = meta.get("settings", {})
    differ = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k)) or ["format"]
    raise DataError(f"data dir {out} was prepared with different settings ({', '.join(differ)} differ); "
                    "choose another data.dir or delete that dir to prepare again")


def _tmp_prefix(out: Path) -> str:
    return f".{out.name}.tmp-{socket.gethostname()}-"


def _remove_stale_tmp(out: Path) -> None:
    """Delete work dirs left by a killed prepare on this host (its pid no longer runs)."""
    prefix = _tmp_prefix(out)
    for p in out.parent.glob(f"{prefix}*"):
        pid = p.name[len(prefix):]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _print_summary(meta: dict, out: Path, console: Callable[[str], object]) -> None:
    s = meta["splits"]
    console(f"prepared data in {out} in {meta['seconds']:.1f}s")
    for name in SPLITS:
        console(f"  {name:5s} {s[name]['documents']:>10,} docs {s[name]['tokens']:>14,} tokens "
                f"in {len(s[name]['shards'])} shard(s)")
    st = SourceStats(**meta["stats"])
    console(f"  read  {st.summary()}")
    console(f"  tokenizer: vocab {meta['vocab_size']:,} ({meta['tokenizer']['how']}), dtype {meta['dtype']}")
