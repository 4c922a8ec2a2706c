"""Text -> documents -> tokenizer -> token shards -> training batches."""

from lmforge.data.prepare import PreparedData, data_dir, load_prepared, prepare, split_of
from lmforge.data.shards import (
    ShardWriter,
    dtype_for_vocab,
    open_shard,
    read_doc_starts,
    read_meta,
    write_meta,
)
from lmforge.data.sources import SourceStats, iter_documents
from lmforge.data.tokenizer import Tokenizer


def __getattr__(name: str):
    # The loader needs torch; importing it lazily keeps curation worker processes light.
    if name == "TokenLoader":
        from lmforge.data.loader import TokenLoader

        return TokenLoader
    raise AttributeError(f"module 'lmforge.data' has no attribute {name!r}")


__all__ = [
    "PreparedData",
    "ShardWriter",
    "SourceStats",
    "TokenLoader",
    "Tokenizer",
    "data_dir",
    "dtype_for_vocab",
    "iter_documents",
    "load_prepared",
    "open_shard",
    "prepare",
    "read_doc_starts",
    "read_meta",
    "split_of",
    "write_meta",
]
