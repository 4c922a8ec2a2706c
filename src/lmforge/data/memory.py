"""Datasets handed over in Python (the SDK's `train_data=` / `eval_data=`): documents as texts or
token-id sequences, turned into one in-memory token stream the TokenLoader windows like a shard."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from lmforge.data.shards import dtype_for_vocab
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import DataError

_BATCH = 1000  # texts per encode_batch call


def token_stream(docs: Iterable[str | Sequence[int]], tokenizer: Tokenizer | None, what: str) -> np.ndarray:
    """All documents of `docs` back to back as one 1-D integer array.

    Texts are encoded with `tokenizer` (required for texts); token-id documents are taken as they
    are. With a tokenizer its end-of-document token follows every document, as `prepare` writes
    shards, so no window mixes two documents without a separator. `what` names the dataset in errors.
    """
    if isinstance(docs, (str, bytes)):
        raise DataError(f"{what}: expected an iterable of documents (texts or token-id lists), got one "
                        f"{type(docs).__name__}; wrap it in a list")
    eos = [tokenizer.eos_id] if tokenizer is not None else []
    parts: list[np.ndarray] = []
    pending: list[str] = []

    def flush() -> None:
        for ids in tokenizer.encode_batch(pending):
            parts.append(np.asarray(ids + eos, dtype=np.int64))
        pending.clear()

    for i, doc in enumerate(docs):
        if isinstance(doc, str):
            if tokenizer is None:
                raise DataError(f"{what}[{i}] is text, but no tokenizer was given to encode it; pass "
                                "tokenizer=... (or token ids)")
            pending.append(doc)
            if len(pending) >= _BATCH:
                flush()
            continue
        if pending:
            flush()
        ids = np.asarray(doc)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise DataError(f"{what}[{i}]: a document is a text or a 1-D sequence of token ids, got "
                            f"{type(doc).__name__} of shape {ids.shape} and dtype {ids.dtype}")
        if ids.size and int(ids.min()) < 0:
            raise DataError(f"{what}[{i}]: token ids must be >= 0, found {int(ids.min())}")
        parts.append(np.concatenate([ids.astype(np.int64), np.asarray(eos, dtype=np.int64)]))
    if pending:
        flush()
    if not parts or not sum(len(p) for p in parts):
        raise DataError(f"{what} holds no tokens")
    stream = np.concatenate(parts)
    return stream.astype(dtype_for_vocab(int(stream.max()) + 1))
