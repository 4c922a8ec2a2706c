"""Exact and near-duplicate detection over a whole corpus: the algorithms the runner orchestrates.

The runner drives them in global stages (as datatrove does), each streaming with bounded memory:

1. per shard: `exact_key` of every document, and `MinHasher.signature`, written with
   `write_signature_file` (one `.npy` per shard: doc keys and signatures side by side);
2. `candidate_pairs_from_signature_files`: one LSH band at a time, the band hashes of all documents
   are sorted with numpy and runs of equal hashes are buckets; no Python dict of buckets, no
   all-pairs comparison. Candidates can be verified on the spot by the estimated Jaccard;
3. `clusters` / `removed_keys`: union-find over the pairs; the smallest doc key of each cluster
   survives, so with keys like (shard_index, record_index) the first occurrence in input order is kept.

`LshIndex` and `near_duplicates` do the same in memory for tests and small corpora.

Hashing is stable across processes and machines (blake2b of words, fixed-seed permutations), because
signatures are computed by separate worker processes and compared later.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

_WORD_RE = re.compile(r"\w+")
_WS_RE = re.compile(r"\s+")
_M64 = (1 << 64) - 1
# Odd 64-bit constants for combining word hashes into n-gram hashes and for the final mix
# (splitmix64's multipliers); changing them changes every stored signature.
_K_COMBINE = np.uint64(0x9E3779B97F4A7C15)
_K_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_K_MIX2 = np.uint64(0x94D049BB133111EB)

Key = Hashable


def exact_key(text: str, normalize: bool = True) -> bytes:
    """16-byte blake2b digest of `text`; with `normalize`, of its lower-cased, whitespace-collapsed form."""
    if normalize:
        text = _WS_RE.sub(" ", text.lower()).strip()
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def words(text: str) -> list[str]:
    """Lower-cased words of `text` (runs of Unicode word characters; punctuation and spacing dropped)."""
    return _WORD_RE.findall(text.lower())


# bytes.translate table: ASCII letters and digits stay, every other ASCII byte becomes a space;
# bytes >= 128 (UTF-8 of non-ASCII characters) stay, so non-Latin words are kept whole.
_SEP_TABLE = bytes(b if (b >= 128 or chr(b).isalnum()) else 32 for b in range(256))


def shingle_words(text: str) -> list[bytes]:
    """The words MinHash shingles are made of: lower-cased, split on ASCII punctuation and spacing.

    A byte-level `translate` + `split` is about 3x faster than `re.findall(r"\\w+")`, which matters
    at thousands of documents per second; non-ASCII punctuation stays attached to its word, which
    is harmless for near-duplicate detection (both copies are split the same way).
    """
    return text.lower().encode("utf-8", "surrogatepass").translate(_SEP_TABLE).split()


def _mix64(h: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, in place on a uint64 array: spreads every input bit over every output bit."""
    h ^= h >> np.uint64(30)
    h *= _K_MIX1
    h ^= h >> np.uint64(27)
    h *= _K_MIX2
    h ^= h >> np.uint64(31)
    return h


def _blake64(word: str | bytes) -> int:
    if isinstance(word, str):
        word = word.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(word, digest_size=8).digest(), "little")


class _WordCache(dict):
    """word -> blake2b-64, filled on a miss (so the hit path is a C-level `map`)."""

    def __missing__(self, word: str | bytes) -> int:
        h = self[word] = _blake64(word)
        return h


class ShingleHasher:
    """Stable 64-bit hashes of word n-grams.

    Each distinct word is hashed once with blake2b (cached: natural text has a small working
    vocabulary), and n-gram hashes are then combined from word hashes with numpy, so the per-document
    Python work is one dict lookup per word. Words may be `str` or `bytes` (a str hashes as its UTF-8).
    """

    def __init__(self, ngram: int, cache_size: int = 1 << 20) -> None:
        if ngram < 1:
            raise ValueError(f"ngram must be >= 1, got {ngram}")
        self.ngram = ngram
        self.cache_size = cache_size
        self._cache = _WordCache()

    def word_hashes(self, ws: Sequence[str | bytes]) -> np.ndarray:
        """uint64 blake2b hash of each word, in order."""
        if len(self._cache) > self.cache_size:
            self._cache.clear()  # bounded memory; the cache is only a speed-up
        return np.fromiter(map(self._cache.__getitem__, ws), dtype=np.uint64, count=len(ws))

    def __call__(self, ws: Sequence[str | bytes], short_as_one: bool = True) -> np.ndarray:
        """uint64 hashes of the overlapping word n-grams of `ws`, in order.

        With fewer than `ngram` words, the whole sequence is one shingle if `short_as_one` (so short
        documents still get a signature), else there are none.
        """
        n = self.ngram
        if len(ws) < n and not short_as_one:
            return np.empty(0, dtype=np.uint64)
        wh = self.word_hashes(ws)
        m = max(len(ws) - n + 1, 1)
        n = min(n, len(ws))
        h = np.full(m, np.uint64(n), dtype=np.uint64)  # seeded with the gram length
        with np.errstate(over="ignore"):
            for j in range(n):  # polynomial combination (order matters), wrapping mod 2^64
                h *= _K_COMBINE
                h ^= wh[j : j + m]
            return _mix64(h)


class MinHasher:
    """MinHash signatures of word n-gram shingles.

    Permutation i maps a 32-bit shingle hash x to ((a_i * x + b_i) mod 2^64) >> 32 with random 64-bit
    a_i (odd) and b_i: Dietzfelbinger's multiply-add-shift family, which is exactly 2-independent for
    32-bit keys and needs no modulo (cheaper than (a*x+b) mod 2^61-1, and free of uint64 overflow).
    The shift is monotone, so it is applied after the minimum: per document the work is one outer
    multiply-add and one min-reduction in numpy.
    """

    _CHUNK = 4096  # shingles per block: bounds the (shingles, num_perm) temporary to 4 MiB at 128 perms

    def __init__(self, num_perm: int = 128, ngram: int = 5, seed: int = 1) -> None:
        if num_perm < 1:
            raise ValueError(f"num_perm must be >= 1, got {num_perm}")
        self.num_perm, self.ngram, self.seed = num_perm, ngram, seed
        self.shingles = ShingleHasher(ngram)
        rng = np.random.Generator(np.random.PCG64(seed))
        self._a = rng.integers(0, 1 << 64, size=num_perm, dtype=np.uint64, endpoint=False) | np.uint64(1)
        self._b = rng.integers(0, 1 << 64, size=num_perm, dtype=np.uint64, endpoint=False)
        self._b_col = self._b[:, None]

    def shingle_hashes(self, text: str) -> np.ndarray:
        """The document's 32-bit shingle hashes (as uint64; repeats are kept, they cannot change a min)."""
        return self.shingles(shingle_words(text)) >> np.uint64(32)

    def signature(self, text: str) -> np.ndarray:
        """uint32 array (num_perm,): the minimum of each permutation over the document's shingles."""
        return self.signature_of_shingles(self.shingle_hashes(text))

    def signature_of_shingles(self, x: np.ndarray) -> np.ndarray:
        """Signature of a set of 32-bit shingle hashes (uint64 array, values < 2^32, at least one)."""
        best = np.full(self.num_perm, np.uint64(_M64), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for start in range(0, len(x), self._CHUNK):
                block = np.multiply.outer(self._a, x[start : start + self._CHUNK])  # (P, S)
                block += self._b_col
                np.minimum(best, block.min(axis=1), out=best)
        return (best >> np.uint64(32)).astype(np.uint32)

    def signatures(self, texts: Iterable[str]) -> np.ndarray:
        """Stacked signatures, (len(texts), num_perm) uint32."""
        sigs = [self.signature(t) for t in texts]
        return np.stack(sigs) if sigs else np.empty((0, self.num_perm), dtype=np.uint32)


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """Jaccard similarity estimated from two MinHash signatures: the fraction of equal values."""
    return float(np.mean(np.asarray(sig_a) == np.asarray(sig_b)))


def _integrate(f: Callable[[np.ndarray], np.ndarray], lo: float, hi: float, steps: int = 200) -> float:
    x = np.linspace(lo, hi, steps + 1)
    y = f(x)
    return float(np.sum((y[1:] + y[:-1]) * 0.5) * (hi - lo) / steps)


@functools.lru_cache(maxsize=64)
def optimal_bands(
    threshold: float,
    num_perm: int,
    bands: int | None = None,
    fp_weight: float = 0.5,
    fn_weight: float = 0.5,
) -> tuple[int, int]:
    """(bands, rows) of the LSH banding, bands * rows <= num_perm.

    With `bands` given, rows = num_perm // bands. Otherwise the pair minimising the weighted areas
    under the S-curve P(candidate | s) = 1 - (1 - s^rows)^bands: false positives below `threshold`
    and false negatives above it (the criterion of datasketch's `_optimal_param`).
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    if bands is not None:
        if not 1 <= bands <= num_perm:
            raise ValueError(f"bands must be between 1 and num_perm={num_perm}, got {bands}")
        return bands, num_perm // bands
    best, best_err = (1, num_perm), float("inf")
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            fp = _integrate(lambda s, b=b, r=r: 1 - (1 - s**r) ** b, 0.0, threshold)
            fn = _integrate(lambda s, b=b, r=r: (1 - s**r) ** b, threshold, 1.0)
            err = fp_weight * fp + fn_weight * fn
            if err < best_err:
                best, best_err = (b, r), err
    return best


# Weights for `lsh_params` when candidates are verified by estimated Jaccard: a missed duplicate is
# lost for good, while a false candidate only costs one signature comparison, so lean to recall.
VERIFIED_WEIGHTS = (0.1, 0.9)


def lsh_params(
    threshold: float, num_perm: int, bands: int | None = None, verified: bool = True
) -> tuple[int, int]:
    """(bands, rows) for the pipeline: `optimal_bands` with recall-leaning weights when `verified`.

    At threshold 0.8 and 128 permutations this gives 14 bands of 9 rows: a pair with Jaccard 0.85
    becomes a candidate with probability 0.975 (datasketch's equal weights: 9 x 13, 0.69).
    """
    weights = VERIFIED_WEIGHTS if verified else (0.5, 0.5)
    return optimal_bands(threshold, num_perm, bands, *weights)


def band_hashes(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """uint64 (n, bands): one hash per band of each signature row (rows * bands leading columns used)."""
    sigs = np.asarray(signatures)
    if sigs.ndim == 1:
        sigs = sigs[None, :]
    if bands * rows > sigs.shape[1]:
        raise ValueError(f"bands * rows = {bands * rows} exceeds the signature length {sigs.shape[1]}")
    cols = sigs[:, : bands * rows].astype(np.uint64).reshape(len(sigs), bands, rows)
    h = np.full((len(sigs), bands), np.uint64(rows), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(rows):
            h *= _K_COMBINE
            h ^= cols[:, :, j]
        return _mix64(h)


def _star_pairs(order: np.ndarray, sorted_hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For runs of equal values in `sorted_hashes`, pairs (first index of the run, each other index).

    A bucket of k documents gives k - 1 pairs (not k(k-1)/2): enough for connected components, and
    linear even for a bucket of thousands of boilerplate pages.
    """
    if len(sorted_hashes) < 2:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    starts = np.concatenate(([True], sorted_hashes[1:] != sorted_hashes[:-1]))
    run_id = np.cumsum(starts) - 1
    first = order[np.flatnonzero(starts)]  # with a stable sort: the smallest row of each run
    members = ~starts
    return first[run_id[members]].astype(np.int64), order[members].astype(np.int64)


class LshIndex:
    """In-memory LSH index: signatures are banded; documents sharing a band bucket are candidates."""

    def __init__(self, bands: int, rows: int) -> None:
        self.bands, self.rows = bands, rows
        self._keys: list[Key] = []
        self._sigs: list[np.ndarray] = []
        self._buckets: list[dict[int, list[int]]] = [{} for _ in range(bands)]

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, doc_key: Key, signature: np.ndarray) -> None:
        """Index one document."""
        idx = len(self._keys)
        self._keys.append(doc_key)
        self._sigs.append(np.asarray(signature))
        for band, h in enumerate(band_hashes(signature, self.bands, self.rows)[0].tolist()):
            self._buckets[band].setdefault(h, []).append(idx)

    def candidate_pairs(self, threshold: float | None = None) -> Iterator[tuple[Key, Key]]:
        """Pairs of doc keys sharing at least one bucket, each pair once, smaller key first.

        Per bucket, the member with the smallest key is paired with each other member (see
        `_star_pairs`). With `threshold`, only pairs whose estimated Jaccard reaches it are yielded.
        """
        seen: set[tuple[int, int]] = set()
        for buckets in self._buckets:
            for members in buckets.values():
                if len(members) < 2:
                    continue
                anchor = min(members, key=lambda i: self._keys[i])
                for other in members:
                    if other == anchor:
                        continue
                    pair = (anchor, other)
                    if pair in seen:
                        continue
                    seen.add(pair)
                    if threshold is not None and (
                        estimated_jaccard(self._sigs[anchor], self._sigs[other]) < threshold
                    ):
                        continue
                    yield self._keys[anchor], self._keys[other]


# --- signature files: one per shard, processed one band at a time -------------------------------


def write_signature_file(path: str | Path, keys: Sequence[Sequence[int]], signatures: np.ndarray) -> Path:
    """Write one shard's doc keys (integer tuples of equal length) and signatures to a `.npy` file.

    The file holds a structured array with fields `key` (int64, key length) and `sig` (uint32,
    num_perm), so it can be memory-mapped by `read_signature_file`. Returns the path written.
    """
    sigs = np.asarray(signatures, dtype=np.uint32)
    key_arr = np.asarray(keys, dtype=np.int64)
    if sigs.ndim != 2 or len(sigs) != len(key_arr):
        raise ValueError(f"need one signature row per key: {len(key_arr)} keys, signatures {sigs.shape}")
    if key_arr.ndim == 1:
        key_arr = key_arr[:, None] if len(key_arr) else key_arr.reshape(0, 1)
    dtype = np.dtype([("key", np.int64, (key_arr.shape[1],)), ("sig", np.uint32, (sigs.shape[1],))])
    rec = np.empty(len(sigs), dtype=dtype)
    rec["key"], rec["sig"] = key_arr, sigs
    path = Path(path)
    if path.suffix != ".npy":
        path = path.with_name(path.name + ".npy")
    np.save(path, rec, allow_pickle=False)
    return path


def read_signature_file(path: str | Path) -> np.ndarray:
    """The structured array of `write_signature_file`, memory-mapped (fields `key` and `sig`)."""
    return np.load(path, mmap_mode="r", allow_pickle=False)


def candidate_pairs_from_signature_files(
    paths: Sequence[str | Path], bands: int, rows: int, threshold: float | None = None
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Candidate duplicate pairs (doc keys as int tuples) from signature files, each pair once.

    Memory is bounded per band: for each band, the files are memory-mapped, the band's hash of every
    document (8 bytes each) is stably argsorted, and runs of equal hashes are the buckets. Rows are
    numbered in (file order, row order), so pass the files in input order to make the first member
    of a bucket its smallest key. The pairs are then the same as `LshIndex.candidate_pairs`.
    With `threshold`, pairs whose estimated Jaccard is below it are dropped (rows are gathered
    from the memory maps in blocks, vectorised).
    """
    files = [read_signature_file(p) for p in paths]
    sizes = np.array([len(f) for f in files], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    total = int(offsets[-1])
    if total < 2:
        return
    firsts, seconds = [], []
    for band in range(bands):
        lo, hi = band * rows, (band + 1) * rows
        hashes = np.concatenate([band_hashes(f["sig"][:, lo:hi], 1, rows)[:, 0] for f in files if len(f)])
        order = np.argsort(hashes, kind="stable")
        a, b = _star_pairs(order, hashes[order])
        firsts.append(a)
        seconds.append(b)
        del hashes, order
    # each unordered pair once: encode (a, b) as a * total + b and take unique codes
    codes = np.unique(np.concatenate(firsts) * total + np.concatenate(seconds))
    del firsts, seconds

    def locate(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        file_of = np.searchsorted(offsets, idx, side="right") - 1
        return file_of, idx - offsets[file_of]

    def gather(idx: np.ndarray, field: str) -> np.ndarray:
        file_of, row = locate(idx)
        out = np.empty((len(idx),) + files[0][field].shape[1:], dtype=files[0][field].dtype)
        for fi in np.unique(file_of).tolist():
            sel = file_of == fi
            out[sel] = files[fi][field][row[sel]]
        return out

    block = 1 << 16
    for start in range(0, len(codes), block):
        c = codes[start : start + block]
        a, b = c // total, c % total
        if threshold is not None:
            sim = np.mean(gather(a, "sig") == gather(b, "sig"), axis=1)
            keep = sim >= threshold
            a, b = a[keep], b[keep]
        ka, kb = gather(a, "key").tolist(), gather(b, "key").tolist()
        for x, y in zip(ka, kb):
            x, y = tuple(x), tuple(y)
            yield (x, y) if x <= y else (y, x)


# --- clustering -----------------------------------------------------------------------------------


class UnionFind:
    """Disjoint sets over hashable keys: path compression and union by size; tracks each set's min key."""

    def __init__(self) -> None:
        self.parent: dict[Any, Any] = {}
        self.size: dict[Any, int] = {}
        self.smallest: dict[Any, Any] = {}

    def add(self, x: Any) -> None:
        if x not in self.parent:
            self.parent[x], self.size[x], self.smallest[x] = x, 1, x

    def find(self, x: Any) -> Any:
        """The root of x's set (x is added if new)."""
        self.add(x)
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:  # path compression
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, x: Any, y: Any) -> bool:
        """Merge the sets of x and y; False if they were already one set."""
        rx, ry = self.find(x), self.find(y)
        if rx == ry:
            return False
        if self.size[rx] < self.size[ry]:
            rx, ry = ry, rx
        self.parent[ry] = rx
        self.size[rx] += self.size.pop(ry)
        self.smallest[rx] = min(self.smallest[rx], self.smallest.pop(ry))
        return True

    def min_of(self, x: Any) -> Any:
        """The smallest key in x's set."""
        return self.smallest[self.find(x)]

    def groups(self) -> list[list[Any]]:
        """All sets, each sorted, ordered by their smallest key."""
        out: dict[Any, list[Any]] = {}
        for x in self.parent:
            out.setdefault(self.find(x), []).append(x)
        return sorted((sorted(g) for g in out.values()), key=lambda g: g[0])


def clusters(
    pairs: Iterable[tuple[Any, Any]], verify: Callable[[Any, Any], bool] | None = None
) -> list[list[Any]]:
    """Connected components (of size >= 2) of the duplicate graph, each sorted: element 0 survives.

    `verify(a, b)`, when given, is asked about each pair first (e.g. estimated Jaccard >= threshold)
    and rejected pairs are not edges.
    """
    uf = UnionFind()
    for a, b in pairs:
        if a == b or (verify is not None and not verify(a, b)):
            continue
        uf.union(a, b)
    return [g for g in uf.groups() if len(g) > 1]


def removed_keys(
    pairs: Iterable[tuple[Any, Any]], verify: Callable[[Any, Any], bool] | None = None
) -> set[Any]:
    """Keys to drop: every member of every cluster except its smallest key."""
    return {k for g in clusters(pairs, verify) for k in g[1:]}


def jaccard_verifier(
    signature_of: Callable[[Any], np.ndarray], threshold: float
) -> Callable[[Any, Any], bool]:
    """A `verify` for `clusters`: estimated Jaccard of the two keys' signatures >= threshold."""
    return lambda a, b: estimated_jaccard(signature_of(a), signature_of(b)) >= threshold


def near_duplicates(
    texts_or_signatures: Sequence[str] | np.ndarray,
    threshold: float = 0.8,
    num_perm: int = 128,
    ngram: int = 5,
    seed: int = 1,
    bands: int | None = None,
    keys: Sequence[Any] | None = None,
    verify: bool = True,
) -> set[Any]:
    """Keys of the documents to remove as near-duplicates (in memory; for tests and small corpora).

    Accepts texts or a (n, num_perm) signature array; keys default to positions 0..n-1. With
    `verify`, candidate pairs below `threshold` estimated Jaccard are discarded.
    """
    if isinstance(texts_or_signatures, np.ndarray) and texts_or_signatures.ndim == 2:
        sigs = texts_or_signatures
        num_perm = sigs.shape[1]
    else:
        sigs = MinHasher(num_perm, ngram, seed).signatures(texts_or_signatures)
    keys = list(range(len(sigs))) if keys is None else list(keys)
    if len(keys) != len(sigs):
        raise ValueError(f"{len(keys)} keys for {len(sigs)} documents")
    b, r = lsh_params(threshold, num_perm, bands, verified=verify)
    index = LshIndex(b, r)
    for k, s in zip(keys, sigs):
        index.add(k, s)
    return removed_keys(index.candidate_pairs(threshold if verify else None))
