import json
import random

import pytest

from lmforge.config.schema import DataConfig
from lmforge.data.sources import SourceStats, iter_documents, python_stdlib_files
from lmforge.errors import DataError

WORDS = "the model reads tokens while a tokenizer splits text into pieces and shards hold them".split()


def paragraph(seed: int, n: int = 40) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".\n"


def read(sources, **kw):
    stats = SourceStats()
    docs = list(iter_documents(DataConfig(sources=[str(s) for s in sources], **kw), stats))
    return docs, stats


def test_folder_reads_text_md_jsonl_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.md").write_text(paragraph(2))
    (tmp_path / "a.txt").write_text(paragraph(1))
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": paragraph(3)}) + "\n\n" +
                                      json.dumps({"text": paragraph(4), "id": 7}) + "\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / ".hidden.txt").write_text("never read")
    docs, stats = read([tmp_path])
    assert docs == [paragraph(1), paragraph(2), paragraph(3), paragraph(4)]
    assert (stats.files, stats.documents, stats.skipped_other_ext) == (3, 4, 1)
    assert stats.chars == sum(map(len, docs))
    assert "4 documents" in stats.summary() and "other extension" in stats.summary()


def test_explicit_file_of_any_extension_and_custom_text_key(tmp_path):
    f = tmp_path / "notes.rst"
    f.write_text("Ünïcödé 漢字 😀\n")
    j = tmp_path / "d.jsonl"
    j.write_text(json.dumps({"content": "hello"}) + "\n")
    docs, _ = read([f, j], text_key="content")
    assert docs == ["Ünïcödé 漢字 😀\n", "hello"]


def test_missing_path_names_it(tmp_path):
    with pytest.raises(DataError, match="nope.txt"):
        read([tmp_path / "nope.txt"])


def test_bad_utf8_skip_counts_and_fail_names_path_and_offset(tmp_path):
    (tmp_path / "good.txt").write_text("fine text")
    (tmp_path / "bad.txt").write_bytes(b"abc\xff\xfe def")
    docs, stats = read([tmp_path])
    assert docs == ["fine text"]
    assert stats.skipped_bad_utf8 == 1 and stats.bad_utf8_examples[0].endswith("bad.txt")
    with pytest.raises(DataError, match=r"bad\.txt.*byte offset 3"):
        read([tmp_path], on_bad_utf8="fail")


def test_bad_utf8_line_in_jsonl_reports_file_offset(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text": "ok"}\n{"text": "x\xff"}\n')
    docs, stats = read([f])
    assert docs == ["ok"] and stats.skipped_bad_utf8 == 1
    with pytest.raises(DataError, match=r"d\.jsonl:2.*byte offset 26"):
        read([f], on_bad_utf8="fail")


@pytest.mark.parametrize("line, problem", [
    ('{"text": "unterminated', "malformed JSON"),
    ('{"body": "x"}', "no 'text' key"),
    ('{"text": 42}', "is a int"),
    ('["text"]', "no 'text' key"),
])
def test_broken_jsonl_line_names_file_and_line(tmp_path, line, problem):
    f = tmp_path / "corpus.jsonl"
    f.write_text(json.dumps({"text": "first"}) + "\n" + line + "\n" + json.dumps({"text": "third"}) + "\n")
    with pytest.raises(DataError, match=rf"corpus\.jsonl:2: .*{problem}"):
        read([f])
    docs, stats = read([f], on_bad_json="skip")
    assert docs == ["first", "third"]
    assert stats.skipped_bad_json == 1 and stats.bad_json_examples == [f"{f}:2"]


def test_whitespace_documents_are_skipped_and_counted(tmp_path):
    (tmp_path / "a.txt").write_text("  \n\t\n")
    (tmp_path / "b.txt").write_text("real")
    docs, stats = read([tmp_path])
    assert docs == ["real"] and stats.skipped_empty == 1


def test_max_chars_stops_exactly_and_streams(tmp_path):
    for i in range(5):
        (tmp_path / f"{i}.txt").write_text(paragraph(i))
    docs, stats = read([tmp_path], max_chars=len(paragraph(0)) + 10)
    assert docs == [paragraph(0), paragraph(1)[:10]]
    assert stats.truncated and stats.chars == len(paragraph(0)) + 10 and stats.files == 2

    stats = SourceStats()
    it = iter_documents(DataConfig(sources=[str(tmp_path)]), stats)
    next(it)
    assert stats.files == 1  # one file read so far: documents are produced lazily


def test_builtin_python_yields_topics_then_stdlib_source():
    docs, stats = read(["builtin:python"], max_chars=300_000)
    assert stats.chars == 300_000 and stats.truncated
    assert len(docs) > 10
    assert any("def " in d for d in docs)  # stdlib source made it in
    files = python_stdlib_files()
    assert len(files) > 100 and files == python_stdlib_files()
    assert not any(part in ("test", "tests", "site-packages", "idlelib") for f in files for part in f.parts)


def test_parquet_files_are_read_by_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from lmforge.config.schema import DataConfig
    from lmforge.data.sources import SourceStats, iter_documents
    from lmforge.errors import DataError

    table = pa.table({"id": ["a", "b", "c"], "text": ["first doc", None, "third doc"]})
    pq.write_table(table, tmp_path / "part-00000.parquet", row_group_size=2)
    stats = SourceStats()
    docs = list(iter_documents(DataConfig(sources=[str(tmp_path)]), stats))
    assert docs == ["first doc", "third doc"] and stats.skipped_bad_json == 1
    with pytest.raises(DataError, match="no 'body' column"):
        list(iter_documents(DataConfig(sources=[str(tmp_path)], text_key="body"), SourceStats()))


def test_max_chars_from_spread_keeps_documents_from_the_whole_corpus(tmp_path):
    # docs then code, as builtin:python is: the first 20% of the characters would be docs only
    for i in range(100):
        (tmp_path / f"{i:03d}.txt").write_text(("prose " if i < 50 else "code ") * 20 + f"{i}\n")
    size = sum(f.stat().st_size for f in tmp_path.iterdir())
    start, _ = read([tmp_path], max_chars=size // 5)
    assert all(d.startswith("prose") for d in start)
    spread, stats = read([tmp_path], max_chars=size // 5, max_chars_from="spread")
    kinds = [d.split()[0] for d in spread]
    assert kinds.count("prose") == kinds.count("code") == 10  # every 5th file, evenly over the whole
    numbers = [int(d.split()[-1]) for d in spread]
    assert max(b - a for a, b in zip(numbers, numbers[1:])) == 5 and numbers[-1] >= 95
    assert stats.chars <= size // 5 and spread == read([tmp_path], max_chars=size // 5,
                                                       max_chars_from="spread")[0]  # deterministic
    everything, _ = read([tmp_path], max_chars=2 * size, max_chars_from="spread")
    assert len(everything) == 100  # more room than the corpus: all of it


def test_spread_needs_max_chars(tmp_path):
    with pytest.raises(ValueError, match="max_chars_from='spread'.*max_chars is not set"):
        DataConfig(sources=[str(tmp_path)], max_chars_from="spread")


def test_source_size_counts_what_a_walk_reads(tmp_path):
    from lmforge.data.sources import source_size

    (tmp_path / "a.txt").write_text("x" * 100)
    (tmp_path / "b.bin").write_bytes(b"y" * 1000)  # not read by a folder walk: not counted
    (tmp_path / ".hidden.txt").write_text("z" * 10)
    assert source_size(str(tmp_path)) == 100 and source_size(str(tmp_path / "b.bin")) == 1000
    assert source_size("builtin:python") > 1_000_000
