import importlib
import random
import socket
import subprocess
import sys

import numpy as np
import pytest

from lmforge.config.schema import Config
from lmforge.data import Tokenizer, load_prepared, open_shard, prepare, read_doc_starts, split_of
from lmforge.errors import DataError

WORDS = ("the quick brown fox jumps over a lazy dog while tokens flow into shards and "
         "models learn to predict the next piece of text").split()
N_DOCS = 60
SEED = 3
prepare_mod = importlib.import_module("lmforge.data.prepare")  # the package attribute is the function


def paragraph(i: int) -> str:
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) + f" [{i}]\n"


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for i in range(N_DOCS):  # names sort in document order: doc_00.txt ... sub/doc_59.txt
        (root / ("sub" if i >= 50 else "") / f"doc_{i:02d}.txt").write_text(paragraph(i))
    return root


def make_cfg(tmp_path, sources, seed=SEED, **data):
    data = {"sources": [str(s) for s in sources], "val_fraction": 0.2, "shard_tokens": 1024,
            "tokenizer": {"vocab_size": 300, "train_chars": 100_000}, **data}
    return Config.model_validate({"run": {"dir": str(tmp_path / "run"), "seed": seed}, "data": data})


def docs_of(prepared, split):
    tok = prepared.tokenizer
    out = []
    for path in prepared.shards(split):
        toks = open_shard(path)
        bounds = list(read_doc_starts(path)) + [len(toks)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            assert toks[b - 1] == tok.eos_id
            out.append(tok.decode(toks[a:b - 1].tolist()))
    return out


def test_prepare_end_to_end(tmp_path, corpus):
    lines = []
    p = prepare(make_cfg(tmp_path, [corpus]), console=lines.append)
    assert p.dir == tmp_path / "run" / "data" and (p.dir / "tokenizer.json").is_file()
    want = {s: [paragraph(i) for i in range(N_DOCS) if split_of(i, SEED, 0.2) == s] for s in ("train", "val")}
    assert 3 <= len(want["val"]) < N_DOCS // 2
    meta = p.meta
    for split in ("train", "val"):
        assert docs_of(p, split) == want[split]  # every document, in order, in the split the hash chose
        assert meta["splits"][split]["documents"] == len(want[split])
        assert p.num_tokens(split) == sum(len(open_shard(f)) for f in p.shards(split))
    assert len(p.shards("train")) > 1  # shard_tokens=1024 forces several
    assert meta["stats"]["documents"] == N_DOCS and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == p.tokenizer.vocab_size == 300 and meta["eos_id"] == p.tokenizer.eos_id
    assert len(meta["fingerprint"]) == 64
    assert any("train" in line and "tokens" in line for line in lines)
    assert load_prepared(p.dir).meta == meta


@pytest.fixture
def tokenizer_texts(monkeypatch):
    """The texts the tokenizer is trained on, as prepare feeds them."""
    seen: list[str] = []
    train = Tokenizer.train.__func__

    def spy(cls, texts, *args, **kw):
        texts = list(texts)
        seen.extend(texts)
        return train(cls, texts, *args, **kw)

    monkeypatch.setattr(Tokenizer, "train", classmethod(spy))
    return seen


def test_tokenizer_sees_train_documents_only(tmp_path, corpus, tokenizer_texts):
    seen = tokenizer_texts
    prepare(make_cfg(tmp_path, [corpus]))
    assert seen == [paragraph(i) for i in range(N_DOCS) if split_of(i, SEED, 0.2) == "train"]


def test_reuse_and_mismatch(tmp_path, corpus, monkeypatch):
    p = prepare(make_cfg(tmp_path, [corpus]))
    monkeypatch.setattr(Tokenizer, "train", None)  # reuse must not train again
    lines = []
    again = prepare(make_cfg(tmp_path, [corpus]), console=lines.append)
    assert again.meta == p.meta and lines == [f"reusing prepared data in {p.dir}"]

    with pytest.raises(DataError, match=rf"{p.dir}.*\(seed differ\).*delete"):
        prepare(make_cfg(tmp_path, [corpus], seed=SEED + 1))
    (corpus / "doc_00.txt").write_text(paragraph(0) + "an edit\n")
    with pytest.raises(DataError, match=r"\(sources differ\)"):
        prepare(make_cfg(tmp_path, [corpus]))


def test_interrupted_prepare_leaves_nothing_that_looks_complete(tmp_path, corpus, monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_mod, "write_meta", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare(make_cfg(tmp_path, [corpus]))
    assert list((tmp_path / "run").iterdir()) == []  # neither the data dir nor the work dir
    monkeypatch.undo()

    # a prepare killed outright leaves its work dir; the next run on this host removes it
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "run" / f".data.tmp-{socket.gethostname()}-{dead.pid}"
    stale.mkdir()
    (stale / "train_000000.bin").write_bytes(b"half")
    p = prepare(make_cfg(tmp_path, [corpus]))
    assert sorted(x.name for x in (tmp_path / "run").iterdir()) == ["data"]
    assert p.meta["stats"]["documents"] == N_DOCS


def test_empty_corpus_and_too_small(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("   \n")
    (empty / "pic.png").write_bytes(b"\x89PNG")
    with pytest.raises(DataError, match=r"no documents found.*empty.*skipped 1 empty.*skipped 1 other"):
        prepare(make_cfg(tmp_path, [empty]))
    (empty / "one.txt").write_text(paragraph(1))
    with pytest.raises(DataError, match="corpus too small: 1 documents"):
        prepare(make_cfg(tmp_path, [empty]))
    assert not (tmp_path / "run" / "data").exists()


def test_existing_tokenizer_and_foreign_dir(tmp_path, corpus):
    first = prepare(make_cfg(tmp_path, [corpus]))
    cfg = make_cfg(tmp_path, [corpus], dir=str(tmp_path / "d2"),
                   tokenizer={"path": str(first.dir / "tokenizer.json")})
    second = prepare(cfg)
    assert second.meta["tokenizer"]["how"].startswith("loaded")
    for split in ("train", "val"):
        assert all(np.array_equal(open_shard(a), open_shard(b))
                   for a, b in zip(first.shards(split), second.shards(split)))

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="holds no meta.json"):
        prepare(make_cfg(tmp_path, [corpus], dir=str(foreign)))


def test_missing_source(tmp_path):
    with pytest.raises(DataError, match="nowhere"):
        prepare(make_cfg(tmp_path, [tmp_path / "nowhere"]))


def test_spread_reads_and_samples_the_tokenizer_over_the_whole_corpus(tmp_path, corpus, tokenizer_texts):
    seen = tokenizer_texts
    size = sum(f.stat().st_size for f in corpus.rglob("*.txt"))
    cfg = make_cfg(tmp_path, [corpus], max_chars=size // 2, max_chars_from="spread",
                   tokenizer={"vocab_size": 300, "train_chars": size // 6})
    p = prepare(cfg)
    read = [int(d.rsplit("[", 1)[1].split("]")[0]) for s in ("train", "val") for d in docs_of(p, s)]
    assert min(read) < 5 and max(read) > 54 and len(read) < N_DOCS * 0.6  # about every other document
    ids = [int(t.rsplit("[", 1)[1].split("]")[0]) for t in seen]
    assert max(ids) > 45  # the tokenizer's third is spread too, not the first documents read
    assert sum(map(len, seen)) <= size // 6 + 200
    with pytest.raises(DataError, match=r"\(max_chars_from differ\)"):  # 'start' is other data
        prepare(make_cfg(tmp_path, [corpus], max_chars=size // 2,
                         tokenizer={"vocab_size": 300, "train_chars": size // 6}))
