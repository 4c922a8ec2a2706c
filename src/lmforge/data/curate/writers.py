"""Shard writers: documents stream to a temp file that is renamed into place only when complete, so a
crash never leaves a partial shard under a final name."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from lmforge.data.curate.doc import Doc
from lmforge.utils.io import disk_error, fsync_dir

PARQUET_BATCH = 1000  # rows buffered per Parquet row group


def doc_record(doc: Doc) -> dict[str, Any]:
    """The output record of a document: id, text, then its source metadata."""
    return {"id": doc.id, "text": doc.text, **doc.meta}


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class AtomicFile:
    """A binary file written under a temp name and renamed to `path` by `commit()` (fsynced)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self.f = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> None:
        try:
            self.f.write(data)
        except OSError as e:
            self.abort()
            raise disk_error(e, str(self.path)) from None

    def commit(self) -> None:
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise disk_error(e, str(self.path)) from None
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        if not self.f.closed:
            self.f.close()
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


class JsonlWriter:
    """One JSON object per line, committed atomically on `close()`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.file = AtomicFile(path)
        self.count = 0

    def write(self, record: dict[str, Any]) -> None:
        self.file.write((dumps(record) + "\n").encode("utf-8"))
        self.count += 1

    def close(self) -> None:
        self.file.commit()

    def abort(self) -> None:
        self.file.abort()


class ParquetWriter:
    """Rows of id, text, source (+ meta as a JSON string) in row groups of PARQUET_BATCH, committed
    atomically on `close()`."""

    def __init__(self, path: str | os.PathLike) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.pa = pa
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        os.close(fd)
        self.schema = pa.schema([("id", pa.string()), ("text", pa.string()), ("source", pa.string()),
                                 ("meta", pa.string())])
        self.writer = pq.ParquetWriter(self.tmp, self.schema)
        self.rows: list[dict[str, Any]] = []
        self.count = 0

    def write(self, record: dict[str, Any]) -> None:
        meta = record.get("meta")
        self.rows.append({"id": record["id"], "text": record["text"], "source": record.get("source"),
                          "meta": dumps(meta) if meta is not None else None})
        self.count += 1
        if len(self.rows) >= PARQUET_BATCH:
            self._flush()

    def _flush(self) -> None:
        if self.rows:
            self.writer.write_table(self.pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows = []

    def close(self) -> None:
        try:
            self._flush()
            self.writer.close()
            with open(self.tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise disk_error(e, str(self.path)) from None
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001 - already failing; the temp file is removed either way
            pass
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def shard_writer(path: str | os.PathLike, fmt: str) -> JsonlWriter | ParquetWriter:
    """A writer for `fmt` ("jsonl" or "parquet")."""
    return ParquetWriter(path) if fmt == "parquet" else JsonlWriter(path)
