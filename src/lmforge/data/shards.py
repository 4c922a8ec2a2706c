"""Binary token shards: `<split>_<NNNNNN>.bin` (header + tokens) with a `.idx` of document starts.

Layout of a .bin file (little-endian):
    bytes 0..1023  header: magic b"LMFSHRD1", u32 version, u32 dtype code (bytes per token: 2 or 4),
                   u64 token count, u64 document count, zero padding
    bytes 1024..   the tokens, uint16 when the vocabulary fits in 16 bits, else uint32
Every document is followed by the EOS token and lies whole inside one shard. The .idx sidecar holds
the uint64 start offset of each document in its shard. Both files are written under a temporary
name and renamed once complete, so a shard that exists is a whole shard.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lmforge.errors import DataError
from lmforge.utils.io import atomic_write_bytes, atomic_write_json, disk_error, fsync_dir

MAGIC = b"LMFSHRD1"
VERSION = 1
HEADER_BYTES = 1024
_HEADER = struct.Struct("<8sIIQQ")
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
META_FILE = "meta.json"
_FLUSH_TOKENS = 1 << 20  # buffer this many tokens before writing: few syscalls, bounded memory


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in 16 bits, else uint32."""
    return _DTYPES[2] if vocab_size <= 1 << 16 else _DTYPES[4]


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


class ShardWriter:
    """Append documents (token ids, EOS included) to numbered shards of at most `shard_tokens` tokens.

    A document never straddles two shards; one longer than `shard_tokens` gets a shard of its own.
    """

    def __init__(self, dir: str | Path, split: str, dtype: np.dtype | str, shard_tokens: int):
        self.dir = Path(dir)
        self.split = split
        self.dtype = np.dtype(dtype).newbyteorder("<")
        if self.dtype.itemsize not in _DTYPES or self.dtype.kind != "u":
            raise ValueError(f"shard dtype must be uint16 or uint32, got {dtype}")
        self.shard_tokens = shard_tokens
        self.files: list[str] = []  # names of the finished shards
        self.num_tokens = 0
        self.num_docs = 0
        self._limit = 1 << (8 * self.dtype.itemsize)
        self._buf: list[np.ndarray] = []
        self._buf_tokens = 0
        self._file = None
        self._shard_tokens = 0
        self._starts: list[int] = []
        self.dir.mkdir(parents=True, exist_ok=True)

    def add(self, doc_ids: Sequence[int] | np.ndarray) -> None:
        """Append one document (its ids, the trailing EOS included)."""
        arr = np.asarray(doc_ids)
        if arr.size == 0:
            return
        if int(arr.max()) >= self._limit or int(arr.min()) < 0:
            raise DataError(f"token id {int(arr.max())} does not fit the shard dtype {self.dtype.name}; "
                            "the tokenizer's vocab_size decides the dtype")
        if self._file is not None and self._shard_tokens + arr.size > self.shard_tokens:
            self._finish_shard()
        if self._file is None:
            self._open_shard()
        self._starts.append(self._shard_tokens)
        self._buf.append(arr.astype(self.dtype, copy=False))
        self._buf_tokens += arr.size
        self._shard_tokens += arr.size
        self.num_tokens += arr.size
        self.num_docs += 1
        if self._buf_tokens >= _FLUSH_TOKENS:
            self._flush()

    def close(self) -> list[str]:
        """Finish the last shard; returns the names of all shards written."""
        if self._file is not None:
            self._finish_shard()
        return self.files

    def _path(self) -> Path:
        return self.dir / shard_name(self.split, len(self.files))

    def _open_shard(self) -> None:
        self._tmp = self._path().with_name(f".{self._path().name}.tmp")
        self._file = open(self._tmp, "wb")
        self._file.write(b"\0" * HEADER_BYTES)  # real header written once the counts are known
        self._shard_tokens = 0
        self._starts = []

    def _flush(self) -> None:
        try:
            for a in self._buf:
                a.tofile(self._file)
        except OSError as e:
            raise disk_error(e, str(self._tmp)) from None
        self._buf, self._buf_tokens = [], 0

    def _finish_shard(self) -> None:
        self._flush()
        path = self._path()
        try:
            self._file.seek(0)
            self._file.write(_HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self._shard_tokens,
                                          len(self._starts)))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            # the index first: a .bin that exists always has its .idx
            atomic_write_bytes(path.with_suffix(".idx"), np.asarray(self._starts, dtype="<u8").tobytes())
            os.replace(self._tmp, path)
        except OSError as e:
            raise disk_error(e, str(path)) from None
        fsync_dir(self.dir)
        self.files.append(path.name)


def _read_header(path: Path) -> tuple[np.dtype, int, int]:
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(f"shard {path} does not exist; prepare the data again") from None
    if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise DataError(f"{path} is not an lmforge token shard (bad magic or header shorter than "
                        f"{HEADER_BYTES} bytes)")
    _, version, code, n_tokens, n_docs = _HEADER.unpack_from(head)
    if version != VERSION or code not in _DTYPES:
        raise DataError(f"{path}: unsupported shard version {version} / dtype code {code}")
    expected = HEADER_BYTES + n_tokens * code
    if size != expected:
        raise DataError(f"{path} is truncated or corrupt: {size} bytes on disk, header says {n_tokens} "
                        f"tokens ({expected} bytes); prepare the data again")
    return _DTYPES[code], n_tokens, n_docs


def open_shard(path: str | Path) -> np.memmap:
    """Memory-map the tokens of one shard (read-only) after checking its header and size."""
    path = Path(path)
    dtype, n_tokens, _ = _read_header(path)
    if n_tokens == 0:  # mmap cannot map zero bytes
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n_tokens,))


def read_doc_starts(path: str | Path) -> np.ndarray:
    """Start offset of each document in the shard at `path` (from its .idx sidecar)."""
    path = Path(path)
    _, _, n_docs = _read_header(path)
    idx = path.with_suffix(".idx")
    starts = np.fromfile(idx, dtype="<u8") if idx.is_file() else None
    if starts is None or len(starts) != n_docs:
        raise DataError(f"{idx} is missing or does not match {path.name} ({n_docs} documents); "
                        "prepare the data again")
    return starts


def read_meta(dir: str | Path) -> dict | None:
    """The prepared data's meta.json, or None when there is none."""
    path = Path(dir) / META_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}); delete the data dir and prepare again") from None


def write_meta(dir: str | Path, meta: dict) -> None:
    """Write meta.json atomically (it marks a prepared dir as complete, so it is written last)."""
    atomic_write_json(Path(dir) / META_FILE, meta)
