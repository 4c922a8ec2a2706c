import numpy as np
import pytest

from lmforge.data.shards import (
    HEADER_BYTES,
    ShardWriter,
    dtype_for_vocab,
    open_shard,
    read_doc_starts,
    read_meta,
    write_meta,
)
from lmforge.errors import DataError

EOS = 0


def make_docs(n: int, high: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(1, high, size=int(rng.integers(1, 700))), EOS) for _ in range(n)]


def write(tmp_path, docs, dtype, shard_tokens=1024, split="train"):
    w = ShardWriter(tmp_path, split, dtype, shard_tokens)
    for d in docs:
        w.add(d)
    return w, w.close()


def test_dtype_for_vocab():
    assert dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.uint32


@pytest.mark.parametrize("dtype, high", [(np.uint16, 65536), (np.uint32, 200_000)])
def test_round_trip_docs_whole_in_shards(tmp_path, dtype, high):
    docs = make_docs(20, high)
    w, files = write(tmp_path, docs, dtype)
    assert files == [f"train_{i:06d}.bin" for i in range(len(files))] and len(files) > 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files + [f.replace(".bin", ".idx")
                                                                         for f in files])  # no temp files
    got = []
    for f in files:
        toks = open_shard(tmp_path / f)
        assert isinstance(toks, np.memmap) and toks.dtype == dtype
        assert (tmp_path / f).stat().st_size == HEADER_BYTES + toks.size * np.dtype(dtype).itemsize
        assert toks.size <= 1024 or len(read_doc_starts(tmp_path / f)) == 1  # only a lone long doc overflows
        bounds = list(read_doc_starts(tmp_path / f)) + [toks.size]
        got += [np.asarray(toks[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    assert len(got) == len(docs) and all(np.array_equal(a, b) for a, b in zip(got, docs))
    assert all(d[-1] == EOS for d in got)  # each document ends at its EOS
    assert w.num_tokens == sum(map(len, docs)) and w.num_docs == len(docs)


def test_oversized_document_gets_its_own_shard(tmp_path):
    docs = [np.arange(1, 100), np.arange(1, 3000), np.arange(1, 10)]
    _, files = write(tmp_path, docs, np.uint16, shard_tokens=1024)
    assert [open_shard(tmp_path / f).size for f in files] == [99, 2999, 9]


def test_uint16_overflow_is_an_error(tmp_path):
    w = ShardWriter(tmp_path, "train", np.uint16, 1024)
    with pytest.raises(DataError, match="does not fit"):
        w.add([1, 70_000, 0])


def test_truncated_shard_detected(tmp_path):
    _, files = write(tmp_path, make_docs(3, 1000), np.uint16, shard_tokens=1 << 20)
    path = tmp_path / files[0]
    data = path.read_bytes()
    path.write_bytes(data[:-2])
    with pytest.raises(DataError, match="truncated"):
        open_shard(path)
    path.write_bytes(data[:500])
    with pytest.raises(DataError, match="not an lmforge token shard"):
        open_shard(path)


def test_foreign_file_and_missing_index_detected(tmp_path):
    foreign = tmp_path / "x.bin"
    foreign.write_bytes(b"GPT2SHRD" + bytes(2000))
    with pytest.raises(DataError, match="not an lmforge token shard"):
        open_shard(foreign)
    _, files = write(tmp_path, make_docs(3, 1000), np.uint16, shard_tokens=1 << 20)
    (tmp_path / files[0].replace(".bin", ".idx")).unlink()
    with pytest.raises(DataError, match="missing"):
        read_doc_starts(tmp_path / files[0])


def test_meta_round_trip(tmp_path):
    assert read_meta(tmp_path) is None
    write_meta(tmp_path, {"vocab_size": 300, "splits": {"train": {"tokens": 5}}})
    assert read_meta(tmp_path) == {"vocab_size": 300, "splits": {"train": {"tokens": 5}}}
    (tmp_path / "meta.json").write_text("{broken")
    with pytest.raises(DataError, match="not valid JSON"):
        read_meta(tmp_path)
