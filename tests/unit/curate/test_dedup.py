"""Exact keys, MinHash signatures, LSH candidates, clustering, and near-duplicate recall/precision."""

from __future__ import annotations

import random
import re
from itertools import combinations
from pydoc_data.topics import topics

import numpy as np
import pytest

from lmforge.data.curate.dedup import (
    LshIndex,
    MinHasher,
    UnionFind,
    candidate_pairs_from_signature_files,
    clusters,
    estimated_jaccard,
    exact_key,
    jaccard_verifier,
    lsh_params,
    near_duplicates,
    optimal_bands,
    read_signature_file,
    removed_keys,
    shingle_words,
    write_signature_file,
)

NGRAM = 5


def _corpus(n_docs: int = 200, min_words: int = 100) -> list[str]:
    """Real documents: consecutive paragraphs of the pydoc topics, grouped to >= min_words words."""
    docs, buf, count = [], [], 0
    for key in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[key]):
            buf.append(para)
            count += len(para.split())
            if count >= min_words:
                docs.append("\n\n".join(buf))
                buf, count = [], 0
                if len(docs) == n_docs:
                    return docs
    return docs


def _shingles(text: str, n: int = NGRAM) -> set[tuple[bytes, ...]]:
    ws = shingle_words(text)
    return set(zip(*(ws[i:] for i in range(n)))) if len(ws) >= n else {tuple(ws)}


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b)


def _edit(text: str, n_edits: int, rng: random.Random) -> str:
    """Replace or delete `n_edits` random words (each changes up to NGRAM shingles)."""
    ws = text.split()
    for _ in range(n_edits):
        i = rng.randrange(len(ws))
        if rng.random() < 0.5 and len(ws) > 1:
            del ws[i]
        else:
            ws[i] = f"zz{rng.randrange(10**9)}"
    return " ".join(ws)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    docs = _corpus()
    assert len(docs) == 200 and all(len(d.split()) >= 100 for d in docs)
    return docs


@pytest.fixture(scope="module")
def injected(corpus):
    """200 originals followed by 120 edited copies, with the exact shingle Jaccard of every pair."""
    rng = random.Random(0)
    texts = list(corpus)
    for i in rng.sample(range(len(corpus)), 120):
        words = len(corpus[i].split())
        frac = rng.choice([0.0, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.08])
        texts.append(_edit(corpus[i], max(int(round(frac * words)), 0 if frac == 0 else 1), rng))
    sh = [_shingles(t) for t in texts]
    truth = {(i, j): _jaccard(sh[i], sh[j]) for i, j in combinations(range(len(texts)), 2)}
    return texts, truth


# --- exact keys -------------------------------------------------------------------------------------


def test_exact_key_normalisation():
    a, b = "Hello   World\n", "hello world"
    assert len(exact_key(a)) == 16
    assert exact_key(a, normalize=True) == exact_key(b, normalize=True)
    assert exact_key(a, normalize=False) != exact_key(b, normalize=False)
    assert exact_key(b, normalize=False) == exact_key("hello world", normalize=False)
    assert exact_key("hello world") != exact_key("hello, world")  # punctuation is content


# --- signatures -------------------------------------------------------------------------------------


def test_signature_deterministic_and_typed(corpus):
    mh = MinHasher(num_perm=128, ngram=5, seed=1)
    s1 = mh.signature(corpus[0])
    assert s1.shape == (128,) and s1.dtype == np.uint32
    assert np.array_equal(s1, MinHasher(128, 5, 1).signature(corpus[0]))  # fresh instance, same seed
    assert np.array_equal(s1, mh.signature(corpus[0].upper()))  # words are lower-cased
    assert not np.array_equal(s1, MinHasher(128, 5, 2).signature(corpus[0]))
    assert estimated_jaccard(s1, mh.signature(corpus[1])) < 0.2


def test_signature_short_docs():
    mh = MinHasher(64, ngram=5, seed=1)
    assert np.array_equal(mh.signature("just three words"), mh.signature("Just, three words!"))
    assert estimated_jaccard(mh.signature("just three words"), mh.signature("just four words")) < 0.2
    assert mh.signature("").shape == (64,)


def test_estimated_jaccard_close_to_true(corpus):
    mh = MinHasher(num_perm=128, ngram=5, seed=3)
    rng = random.Random(1)
    errors = []
    for i, frac in enumerate([0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3]):
        a = corpus[10 + i]
        b = _edit(a, max(1, int(frac * len(a.split()))), rng)
        true = _jaccard(_shingles(a), _shingles(b))
        est = estimated_jaccard(mh.signature(a), mh.signature(b))
        errors.append(abs(est - true))
    assert max(errors) <= 0.1, errors


# --- banding ----------------------------------------------------------------------------------------


def test_optimal_bands():
    assert optimal_bands(0.8, 128) == (9, 13)  # datasketch's choice for these settings
    assert optimal_bands(0.8, 128, bands=16) == (16, 8)
    b, r = lsh_params(0.8, 128)
    assert b * r <= 128 and 1 - (1 - 0.85**r) ** b > 0.95  # recall-leaning when verified
    b5, r5 = optimal_bands(0.5, 128)
    assert r5 < 13  # a lower threshold needs fewer rows per band
    with pytest.raises(ValueError):
        optimal_bands(0.8, 128, bands=200)


# --- union-find and clusters ------------------------------------------------------------------------


def test_union_find():
    uf = UnionFind()
    for a, b in [(1, 2), (3, 4), (2, 3), (10, 11), (5, 5)]:
        uf.union(a, b)
    assert uf.find(1) == uf.find(4) and uf.find(1) != uf.find(10)
    assert uf.min_of(4) == 1 and uf.min_of(11) == 10
    assert not uf.union(4, 1)
    assert uf.groups() == [[1, 2, 3, 4], [5], [10, 11]]
    # a long chain stays correct (path compression)
    uf2 = UnionFind()
    for i in range(2000, 0, -1):
        uf2.union(i, i - 1)
    assert uf2.min_of(2000) == 0 and len(uf2.groups()) == 1


def test_clusters_survivor_is_smallest_key():
    pairs = [((2, 5), (0, 7)), ((0, 7), (1, 0)), ((3, 1), (3, 2))]
    assert clusters(pairs) == [[(0, 7), (1, 0), (2, 5)], [(3, 1), (3, 2)]]
    assert removed_keys(pairs) == {(1, 0), (2, 5), (3, 2)}
    # verification removes an edge
    assert removed_keys(pairs, verify=lambda a, b: a[0] != 3) == {(1, 0), (2, 5)}


def test_jaccard_verifier():
    sigs = {"a": np.arange(10), "b": np.r_[np.arange(8), 0, 0], "c": np.zeros(10)}
    ok = jaccard_verifier(sigs.__getitem__, 0.8)
    assert ok("a", "b") and not ok("a", "c")


# --- near duplicates end to end ----------------------------------------------------------------------


def test_near_dup_recall_and_precision(injected):
    texts, truth = injected
    threshold = 0.8
    mh = MinHasher(128, NGRAM, seed=1)
    sigs = mh.signatures(texts)
    bands, rows = lsh_params(threshold, 128)
    index = LshIndex(bands, rows)
    for k, s in enumerate(sigs):
        index.add(k, s)
    edges = list(index.candidate_pairs(threshold))
    groups = clusters(edges)
    cluster_of = {k: gi for gi, g in enumerate(groups) for k in g}

    positives = [p for p, j in truth.items() if j >= 0.85]
    assert len(positives) >= 60  # the injected copies really cover the high-similarity range
    found = sum(1 for a, b in positives if a in cluster_of and cluster_of.get(a) == cluster_of.get(b))
    recall = found / len(positives)
    assert recall >= 0.9, recall

    false = sum(1 for a, b in edges if truth[(min(a, b), max(a, b))] < 0.7)
    precision = 1 - false / max(len(edges), 1)
    assert precision >= 0.9, precision
    # the survivors are the originals: every removed document is a later copy
    removed = {k for g in groups for k in g[1:]}
    assert all(k >= 200 or any(truth[(min(k, o), max(k, o))] >= 0.7 for o in range(k)) for k in removed)
    assert near_duplicates(sigs, threshold) == removed


def test_near_duplicates_texts():
    base = " ".join(f"word{i}" for i in range(300))
    texts = [base, "something else entirely " * 30, base.replace("word7 ", "changed "), base]
    assert near_duplicates(texts, threshold=0.8) == {2, 3}
    assert near_duplicates(texts, threshold=0.8, keys=["d", "c", "b", "a"]) == {"b", "d"}


def test_signature_files_match_in_memory(tmp_path, injected):
    texts, _ = injected
    sigs = MinHasher(128, NGRAM, seed=1).signatures(texts)
    keys = [(i // 100, i % 100) for i in range(len(texts))]
    paths = []
    for shard in range(0, len(texts), 100):
        paths.append(write_signature_file(tmp_path / f"sig-{shard // 100:03d}", keys[shard : shard + 100],
                                          sigs[shard : shard + 100]))
    back = read_signature_file(paths[1])
    assert np.array_equal(back["sig"], sigs[100:200]) and tuple(back["key"][0]) == (1, 0)

    bands, rows = lsh_params(0.8, 128)
    for threshold in (None, 0.8):
        index = LshIndex(bands, rows)
        for k, s in zip(keys, sigs):
            index.add(k, s)
        in_memory = sorted(index.candidate_pairs(threshold))
        from_files = sorted(candidate_pairs_from_signature_files(paths, bands, rows, threshold))
        assert from_files == in_memory and len(in_memory) > 0
        assert len(set(from_files)) == len(from_files)  # each pair once
        assert all(a < b for a, b in from_files)
    assert list(candidate_pairs_from_signature_files(paths[:0], bands, rows)) == []
