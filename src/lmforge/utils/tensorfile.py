"""Reading safetensors files tensor by tensor with plain reads, not a memory map.

The safetensors library memory-maps a file: every page of it a reader copies from stays resident (and
counts in the process's memory) until the file is closed, so importing a model shard by shard peaks at
the model plus a whole shard, and at twice the model for a single-file checkpoint. Here each tensor is
read into its own buffer with one `readinto`, and the file's pages stay in the page cache, which the
kernel reclaims: importing needs the model plus its largest tensor.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes
of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data.
The file is untrusted: the header is bounded, and every entry is checked against the data it claims
before anything is read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

from lmforge.errors import LmforgeError

MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own bound
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile:
    """`with SafetensorsFile(path) as f: f.keys(); f.read(name)`: the header is read and checked on
    opening; `read` returns a new tensor holding one entry's data."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self._file = open(self.path, "rb")  # noqa: SIM115 (closed by close / the context manager)
        try:
            self._entries, self._data_start = self._header()
        except BaseException:
            self._file.close()
            raise

    def _bad(self, why: str) -> LmforgeError:
        return LmforgeError(f"{self.path} is not a readable safetensors file: {why}")

    def _header(self) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], int]:
        size = os.fstat(self._file.fileno()).st_size
        raw = self._file.read(8)
        if len(raw) < 8:
            raise self._bad("shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise self._bad(f"its header claims {n:,} bytes (the file has {size:,}; at most "
                            f"{MAX_HEADER_BYTES:,} are read)")
        try:
            header = json.loads(self._file.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise self._bad(f"its header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._bad("its header is not a JSON object")
        data_len = size - 8 - n
        entries = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = DTYPES[entry["dtype"]]
                shape = tuple(entry["shape"])
                begin, end = entry["data_offsets"]
                ok = (all(type(d) is int and d >= 0 for d in shape) and type(begin) is int
                      and type(end) is int and 0 <= begin <= end <= data_len)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise self._bad(f"tensor {name!r} has a malformed entry {str(entry)[:200]} (the data "
                                f"holds {data_len:,} bytes; dtypes: {', '.join(DTYPES)})")
            want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if end - begin != want:
                raise self._bad(f"tensor {name!r} of shape {list(shape)} and dtype {entry['dtype']} needs "
                                f"{want:,} bytes, its offsets give {end - begin:,}")
            entries[name] = (dtype, shape, begin, end)
        return entries, 8 + n

    def keys(self) -> list[str]:
        return list(self._entries)

    def read(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self._entries[name]
        out = torch.empty(shape, dtype=dtype)
        if end > begin:
            self._file.seek(self._data_start + begin)
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            done = 0
            while done < len(view):  # one read returns at most ~2 GiB on Linux
                got = self._file.readinto(view[done:])
                if not got:
                    raise self._bad(f"tensor {name!r} ends past the end of the file")
                done += got
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_keys(path: str | Path) -> list[str]:
    with SafetensorsFile(path) as f:
        return f.keys()
