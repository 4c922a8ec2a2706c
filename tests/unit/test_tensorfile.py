"""utils/tensorfile.py reads what the safetensors library wrote, bit for bit, for every dtype, and refuses
a file whose header lies (too long, offsets outside the data, a size that does not match the shape, an
unknown dtype, data cut short) with one clear error, before reading any tensor."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from lmforge.errors import LmforgeError
from lmforge.utils.tensorfile import MAX_HEADER_BYTES, SafetensorsFile


def test_reads_every_dtype_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).bfloat16(),
        "f16": torch.randn(2, 2, 2, generator=g).half(), "i64": torch.arange(-3, 9),
        "u8": torch.arange(256, dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "f8": torch.randn(6, generator=g).to(
            torch.float8_e4m3fn),
    }
    save_file(tensors, tmp_path / "t.safetensors", metadata={"format": "pt"})
    with SafetensorsFile(tmp_path / "t.safetensors") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for name, want in tensors.items():
            got = f.read(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


def _file(path, header, data: bytes = b"", n: int | None = None):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if n is None else n) + raw + data)
    return path


@pytest.mark.parametrize("header, data, n, match", [
    ({}, b"", MAX_HEADER_BYTES + 1, "header claims"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None, "malformed entry"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 16, None, "needs 16 bytes"),
    ({"a": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 2]}}, b"\0" * 2, None, "malformed entry"),
    ({"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 0]}}, b"", None, "malformed entry"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, b"\0" * 8, None, "malformed entry"),
    ([1, 2], b"", None, "not a JSON object"),
])
def test_a_lying_header_is_refused_before_any_read(tmp_path, header, data, n, match):
    with pytest.raises(LmforgeError, match=match) as e:
        SafetensorsFile(_file(tmp_path / "bad.safetensors", header, data, n))
    assert "bad.safetensors is not a readable safetensors file" in str(e.value)


def test_garbage_and_truncation(tmp_path):
    (tmp_path / "short").write_bytes(b"\x01\x02")
    with pytest.raises(LmforgeError, match="8-byte header"):
        SafetensorsFile(tmp_path / "short")
    (tmp_path / "junk").write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(LmforgeError, match="not JSON"):
        SafetensorsFile(tmp_path / "junk")
    save_file({"w": torch.ones(1000)}, tmp_path / "cut.safetensors")
    raw = (tmp_path / "cut.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-100])  # the header still fits; the data does not
    with pytest.raises(LmforgeError, match="malformed entry"):
        SafetensorsFile(tmp_path / "cut.safetensors")
