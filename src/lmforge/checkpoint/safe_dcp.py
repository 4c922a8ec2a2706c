"""Reading torch.distributed.checkpoint directories without running code from them.

DCP's filesystem reader unpickles `.metadata` with plain `pickle.load`, and its default load planner
reads every non-tensor value (optimizer hyperparameters, ...) with `torch.load(weights_only=False)`:
a checkpoint from someone else could run any code on load. Here the metadata goes through an
unpickler that only builds DCP's own metadata classes (and torch.Size, dtypes, layouts, paths), and
non-tensor values through `torch.load(weights_only=True)`. Tensors were already read with
weights_only=True by DCP itself. A refused file is a CheckpointError naming what it asked for.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lmforge.errors import CheckpointError

# Everything the metadata of a DCP checkpoint written by torch's FileSystemWriter is built from.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of checkpoint metadata")


def read_metadata(path: str) -> Metadata:
    """The metadata of the DCP checkpoint in directory `path`, built only from allow-listed classes."""
    return SafeFileSystemReader(path)._read_metadata(None)


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader with the metadata read by the allow-listed unpickler (or handed over
    already read, so it is parsed once)."""

    def __init__(self, path: str, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata if self._metadata is not None else self._read_metadata(kwargs.get("rank"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read_metadata(self, rank: int | None) -> Metadata:
        path = self._get_metadata_path(rank)
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError,
                ValueError) as e:
            raise CheckpointError(f"checkpoint metadata {path} was refused: {e}; a checkpoint written by "
                                  "lmforge holds only DCP's own metadata classes") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint metadata {path} holds a {type(metadata).__name__}, not DCP "
                                  "metadata")
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, with non-tensor values read by `torch.load(weights_only=True)` (its own
    `load_bytes` uses weights_only=False); where the value goes is decided as the parent decides."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # weights_only raises UnpicklingError for anything it would not build
            raise CheckpointError(f"checkpoint value {read_item.dest_index.fqn} was refused: "
                                  f"{str(e).splitlines()[0]}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
