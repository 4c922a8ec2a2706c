"""`ChunkEncoder`: the documents of `lmforge prepare` encoded in worker processes (data.workers).

The main process still reads the sources, splits the documents and writes the shards, in document order;
workers only turn chunks of documents into ids. Each worker loads the very tokenizer.json that prepare
saved, a document's ids do not depend on the chunk it travels in (encode_batch encodes each text on its
own), and the results are written in submission order, so the shards are byte for byte those of one
worker. `tokenizers` already spreads one encode_batch call over the cores with threads; processes add the
Python side of the work (reading JSONL, turning id lists into arrays) for large corpora.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lmforge.data.tokenizer import Tokenizer

_worker_tok: Tokenizer | None = None


def resolve_workers(workers: int | str) -> int:
    """data.workers as a number: 'auto' is the usable cores, at most 8."""
    if workers == "auto":
        return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
                          os.cpu_count() or 1, 8))
    return int(workers)


def _init(path: str, eos_id: int) -> None:
    global _worker_tok
    _worker_tok = Tokenizer.load(path, eos_id=eos_id)


def _encode(docs: list[str]) -> list[np.ndarray]:
    assert _worker_tok is not None
    eos = _worker_tok.eos_id
    return [np.asarray([*ids, eos], dtype=np.uint32) for ids in _worker_tok.encode_batch(docs)]


class ChunkEncoder:
    """Encode chunks of (split, document) and hand each document's ids (EOS included) to `write(split,
    ids)` in submission order; in-process with one worker."""

    def __init__(self, tok: Tokenizer, tokenizer_file: Path, workers: int,
                 write: Callable[[str, list[int] | np.ndarray], None]) -> None:
        self.tok, self.write, self.workers = tok, write, workers
        self._pending: deque = deque()
        self._pool = None
        if workers > 1:
            # spawn: the parent's tokenizers thread pool must not be forked (it would deadlock or be
            # switched off in the child)
            ctx = multiprocessing.get_context("spawn")
            self._pool = ctx.Pool(workers, initializer=_init, initargs=(str(tokenizer_file), tok.eos_id))

    def submit(self, chunk: list[tuple[str, str]]) -> None:
        if not chunk:
            return
        if self._pool is None:
            for (split, _), ids in zip(chunk, self.tok.encode_batch([doc for _, doc in chunk])):
                ids.append(self.tok.eos_id)  # every document ends with EOS: packed windows see the end
                self.write(split, ids)
            return
        splits = [split for split, _ in chunk]
        self._pending.append((splits, self._pool.apply_async(_encode, ([doc for _, doc in chunk],))))
        while len(self._pending) > 2 * self.workers:  # bounded: the reader never runs far ahead
            self._write_oldest()

    def drain(self) -> None:
        """Write every chunk submitted so far (before a document written out of band)."""
        while self._pending:
            self._write_oldest()

    def close(self) -> None:
        self.drain()
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def terminate(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def _write_oldest(self) -> None:
        splits, result = self._pending.popleft()
        for split, ids in zip(splits, result.get()):
            self.write(split, ids)
