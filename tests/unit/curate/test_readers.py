"""Curation readers: every input kind, deterministic units, and every kind of bad input (skip / fail)."""

from __future__ import annotations

import json

import pytest

from lmforge.data.curate.readers import BadInput, Reader, plan_pieces, plan_units
from lmforge.errors import DataError


def reader(on_bad="skip", max_line_chars=1_000_000, **kw) -> Reader:
    return Reader(kw.get("text_key", "text"), kw.get("id_key", "id"), on_bad, max_line_chars)


def read_all(inputs, docs_per_shard=1000, **kw):
    pieces, ignored = plan_pieces([str(i) for i in inputs])
    r = reader(**kw)
    docs = [d for unit in plan_units(pieces, docs_per_shard) for d in r.read_unit(unit)]
    return docs, r.bad, ignored


def test_folder_of_text_md_jsonl_parquet_in_sorted_order(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.md").write_text("markdown doc")
    (tmp_path / "a.txt").write_text("text doc")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "first", "id": 7, "url": "u"}) + "\n\n" +
                                      json.dumps({"text": "second"}) + "\n")
    pq.write_table(pa.table({"text": ["p0", "p1", "p2"], "id": ["x", None, "z"]}),
                   tmp_path / "d.parquet", row_group_size=2)
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / ".hidden.txt").write_text("never read")
    docs, bad, ignored = read_all([tmp_path])
    assert [d.text for d in docs] == ["text doc", "markdown doc", "first", "second", "p0", "p1", "p2"]
    assert [d.id for d in docs] == [str(tmp_path / "a.txt"), str(tmp_path / "b" / "z.md"), "7",
                                    f"{tmp_path / 'c.jsonl'}:3", "x", f"{tmp_path / 'd.parquet'}:1", "z"]
    assert docs[2].meta == {"source": str(tmp_path), "meta": {"url": "u"}}
    assert ignored == 1 and bad.total == 0


def test_units_split_big_files_into_ranges_deterministically(tmp_path):
    f = tmp_path / "big.jsonl"
    f.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(23)))
    (tmp_path / "t").mkdir()
    for i in range(5):
        (tmp_path / "t" / f"{i}.txt").write_text(f"file {i}")
    pieces, _ = plan_pieces([str(f), str(tmp_path / "t")])
    units = plan_units(pieces, 10)
    assert [sum(p.stop - p.start for p in u) for u in units] == [10, 10, 8]
    assert [p.to_dict() for p in plan_units(plan_pieces([str(f), str(tmp_path / "t")])[0], 10)[1]] == \
        [p.to_dict() for p in units[1]]
    r = reader()
    texts = [d.text for u in units for d in r.read_unit(u)]
    assert texts == [f"doc {i}" for i in range(23)] + [f"file {i}" for i in range(5)]


def test_hf_saved_dataset_and_dataset_dict(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.ipc as ipc

    def save(d, texts):
        d.mkdir(parents=True)
        table = pa.table({"text": texts, "label": list(range(len(texts)))})
        with ipc.new_stream(str(d / "data-00000-of-00001.arrow"), table.schema) as w:
            for batch in table.to_batches(max_chunksize=2):
                w.write_batch(batch)
        state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}
        (d / "state.json").write_text(json.dumps(state))

    save(tmp_path / "ds", ["a", "b", "c"])
    docs, bad, _ = read_all([f"hf:{tmp_path / 'ds'}"], docs_per_shard=2)
    arrow = tmp_path / "ds" / "data-00000-of-00001.arrow"
    assert [(d.id, d.text) for d in docs] == [(f"{arrow}:0", "a"), (f"{arrow}:1", "b"), (f"{arrow}:2", "c")]

    save(tmp_path / "dd" / "train", ["t1", "t2"])
    save(tmp_path / "dd" / "test", ["e1"])
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    docs, _, _ = read_all([f"hf:{tmp_path / 'dd'}"])
    assert [d.text for d in docs] == ["t1", "t2", "e1"]


def test_builtin_python_is_planned_and_read():
    pieces, _ = plan_pieces(["builtin:python"])
    units = plan_units(pieces, 50)
    assert sum(p.stop - p.start for u in units for p in u) > 200
    docs = list(reader().read_unit(units[0]))
    assert 0 < len(docs) <= 50 and all(d.text.strip() for d in docs)
    assert docs[0].id.startswith("builtin:python:topics/")
    last = list(reader().read_unit(units[-1]))
    assert last and last[-1].id.endswith(".py")


@pytest.fixture
def bad_corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a_good.txt").write_text("good text")
    (d / "b_latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (d / "c_binary.txt").write_bytes(b"line\n\x00\x01\x02")
    (d / "d_empty.md").write_text("  \n")
    (d / "e_long.txt").write_text("short\n" + "x" * 200 + "\n")
    (d / "f.jsonl").write_bytes(
        b'{"text": "ok 1"}\n'
        b'{"text": "broken\n'
        b'{"body": "no text key"}\n'
        b'{"text": 5}\n'
        b'{"text": "caf\xe9"}\n'
        b'{"text": ""}\n'
        b'[1, 2]\n'
        b'{"text": "ok 2"}\n')
    return d


def test_bad_input_is_skipped_counted_with_examples(bad_corpus):
    docs, bad, _ = read_all([bad_corpus], max_line_chars=100)
    assert [d.text for d in docs] == ["good text", "ok 1", "ok 2"]
    f = bad_corpus / "f.jsonl"
    assert dict(bad.counts) == {"bad_utf8": 2, "binary": 1, "empty": 2, "long_line": 1, "bad_json": 2,
                                "missing_text": 2}
    assert bad.examples["bad_utf8"] == [f"{bad_corpus / 'b_latin1.txt'}:1", f"{f}:5"]
    assert bad.examples["binary"] == [f"{bad_corpus / 'c_binary.txt'}:2"]
    assert bad.examples["bad_json"] == [f"{f}:2", f"{f}:7"]
    assert bad.examples["missing_text"] == [f"{f}:3", f"{f}:4"]
    merged = BadInput.from_dict(bad.to_dict())
    merged.merge(bad)
    assert merged.total == 2 * bad.total and len(merged.examples["empty"]) == 3


@pytest.mark.parametrize("name,content,where,words", [
    ("x.txt", "caf\xe9".encode("latin-1"), "x.txt:1", "not valid UTF-8"),
    ("x.txt", b"ab\n\x00", "x.txt:2", "binary"),
    ("x.txt", b"", "x.txt:1", "empty document"),
    ("x.txt", b"y" * 50, "x.txt:1", "max_line_chars"),
    ("x.jsonl", b'{"text": "ok"}\n{"text": \n', "x.jsonl:2", "malformed JSON"),
    ("x.jsonl", b'{"text": "ok"}\n{"body": "b"}\n', "x.jsonl:2", "curate.text_key"),
])
def test_fail_mode_names_file_line_and_fix(tmp_path, name, content, where, words):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError) as e:
        read_all([tmp_path / name], on_bad="fail", max_line_chars=20)
    msg = str(e.value)
    assert f"{tmp_path / where}:" in msg and words in msg and "on_bad_input=skip" in msg


def test_parquet_without_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "x.parquet")
    docs, bad, _ = read_all([tmp_path / "x.parquet"])
    assert docs == [] and bad.counts["missing_text"] == 2
    with pytest.raises(DataError, match="no 'text' column"):
        read_all([tmp_path / "x.parquet"], on_bad="fail")


def test_missing_input_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        plan_pieces([str(tmp_path / "nope")])
