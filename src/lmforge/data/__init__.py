"""Text -> documents -> tokenizer -> token shards -> training batches."""

from lmforge.data.loader import TokenLoader
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
