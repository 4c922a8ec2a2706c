"""Documents from `data.sources`: files, folders, JSONL files and the text that ships with Python.

Everything streams: one document is in memory at a time, and the order is fixed (sorted walks) so two
runs over the same sources yield the same documents in the same order.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lmforge.config.schema import DataConfig
from lmforge.errors import DataError

BUILTIN_PYTHON = "builtin:python"
TEXT_EXTENSIONS = (".txt", ".md")
JSONL_EXTENSIONS = (".jsonl",)
PARQUET_EXTENSIONS = (".parquet",)
MAX_EXAMPLES = 5  # example paths kept per kind of skip: enough to find the culprits, never unbounded

# Stdlib folders that are not text-like prose/code: test suites (huge, full of deliberately odd files),
# GUI demos, bundled wheels, generated tables and build config.
_STDLIB_SKIP_DIRS = {
    "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "turtledemo", "__pycache__",
    "lib-dynload", "ensurepip", "encodings", "pydoc_data",
}


@dataclass
class SourceStats:
    """Counts of what was read and skipped; filled in while `iter_documents` runs."""

    sources: list[str] = field(default_factory=list)
    files: int = 0
    documents: int = 0
    chars: int = 0
    truncated: bool = False  # stopped early at data.max_chars
    skipped_empty: int = 0
    skipped_bad_utf8: int = 0
    skipped_bad_json: int = 0
    skipped_other_ext: int = 0  # files in folders whose extension is not read
    bad_utf8_examples: list[str] = field(default_factory=list)
    bad_json_examples: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the console: what was read and every non-zero skip count."""
        parts = [f"{self.documents:,} documents", f"{self.chars:,} chars", f"{self.files:,} files"]
        for name, n, examples in (
            ("empty", self.skipped_empty, []),
            ("bad UTF-8", self.skipped_bad_utf8, self.bad_utf8_examples),
            ("bad JSON", self.skipped_bad_json, self.bad_json_examples),
            ("other extension", self.skipped_other_ext, []),
        ):
            if n:
                eg = f" (e.g. {', '.join(examples[:2])})" if examples else ""
                parts.append(f"skipped {n:,} {name}{eg}")
        if self.truncated:
            parts.append("stopped at data.max_chars")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    def _note(self, examples: list[str], where: str) -> None:
        if len(examples) < MAX_EXAMPLES:
            examples.append(where)


def iter_documents(cfg: DataConfig, stats: SourceStats) -> Iterator[str]:
    """Yield every document of `cfg.sources` in a fixed order, updating `stats` as it goes.

    Stops once `cfg.max_chars` characters were yielded (the last document is cut to fit exactly).
    Raises DataError for a missing path, and for bad UTF-8 / bad JSON when the matching `on_bad_*`
    setting is "fail".
    """
    for src in cfg.sources:  # fail on a missing path before yielding anything
        if src != BUILTIN_PYTHON and not Path(src).exists():
            raise DataError(f"data source {src!r} does not exist (resolved: {Path(src).resolve()}); "
                            f"give a file, a folder or {BUILTIN_PYTHON!r}")
    budget = cfg.max_chars
    for src in cfg.sources:
        stats.sources.append(src)
        for doc in _iter_source(src, cfg, stats):
            if not doc.strip():
                stats.skipped_empty += 1
                continue
            if budget is not None and len(doc) >= budget - stats.chars:
                doc = doc[: budget - stats.chars]
                stats.truncated = True
                if not doc.strip():
                    return
            stats.documents += 1
            stats.chars += len(doc)
            yield doc
            if stats.truncated:
                return


def _iter_source(src: str, cfg: DataConfig, stats: SourceStats) -> Iterator[str]:
    if src == BUILTIN_PYTHON:
        yield from _iter_builtin_python(cfg, stats)
        return
    path = Path(src)
    if path.is_dir():
        for f in walk_files(path):
            if f.suffix.lower() in TEXT_EXTENSIONS + JSONL_EXTENSIONS + PARQUET_EXTENSIONS:
                yield from _iter_file(f, cfg, stats)
            else:
                stats.skipped_other_ext += 1
    else:
        yield from _iter_file(path, cfg, stats)  # a file named explicitly is read whatever its extension


def walk_files(root: Path, skip_dirs: Collection[str] = ()) -> Iterator[Path]:
    """Files under `root` in sorted path order, hidden entries (.git, editor temp files) left out."""
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        if e.name.startswith("."):
            continue
        if e.is_dir():
            if e.name not in skip_dirs:
                yield from walk_files(Path(e.path), skip_dirs)
        else:
            yield Path(e.path)


def _iter_file(path: Path, cfg: DataConfig, stats: SourceStats) -> Iterator[str]:
    if path.suffix.lower() in JSONL_EXTENSIONS:
        yield from _iter_jsonl(path, cfg, stats)
        return
    if path.suffix.lower() in PARQUET_EXTENSIONS:
        yield from _iter_parquet(path, cfg, stats)
        return
    text = _decode(path.read_bytes(), str(path), 0, cfg, stats)
    stats.files += 1
    if text is not None:
        yield text


def _decode(data: bytes, where: str, base_offset: int, cfg: DataConfig, stats: SourceStats) -> str | None:
    """UTF-8 text of `data`, or None when it is invalid and on_bad_utf8 == "skip"."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if cfg.on_bad_utf8 == "fail":
            raise DataError(f"{where}: not valid UTF-8 at byte offset {base_offset + e.start} ({e.reason}); "
                            "fix or remove the file, or set data.on_bad_utf8=skip") from None
        stats.skipped_bad_utf8 += 1
        stats._note(stats.bad_utf8_examples, where)
        return None


def _iter_jsonl(path: Path, cfg: DataConfig, stats: SourceStats) -> Iterator[str]:
    """One document per line; UTF-8 and JSON are checked line by line so a big file streams."""
    stats.files += 1
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            line = _decode(raw, f"{path}:{lineno}", start, cfg, stats)
            if line is None or not line.strip():
                continue  # blank lines are allowed in JSONL files (a trailing newline, say)
            try:
                record = json.loads(line)
                problem = None
            except json.JSONDecodeError as e:
                problem = f"malformed JSON ({e.msg} at column {e.colno})"
            if problem is None:
                if not isinstance(record, dict) or cfg.text_key not in record:
                    problem = f"record has no {cfg.text_key!r} key (set data.text_key to the text field)"
                elif not isinstance(record[cfg.text_key], str):
                    problem = f"{cfg.text_key!r} is a {type(record[cfg.text_key]).__name__}, not a string"
            if problem is not None:
                if cfg.on_bad_json == "fail":
                    raise DataError(f"{path}:{lineno}: {problem}; fix the line or set data.on_bad_json=skip")
                stats.skipped_bad_json += 1
                stats._note(stats.bad_json_examples, f"{path}:{lineno}")
                continue
            yield record[cfg.text_key]


def _iter_parquet(path: Path, cfg: DataConfig, stats: SourceStats) -> Iterator[str]:
    """One document per row of the text column, streamed a row group at a time (`lmforge data`
    writes Parquet shards this reads)."""
    import pyarrow.parquet as pq

    stats.files += 1
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError family
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    if cfg.text_key not in pf.schema_arrow.names:
        raise DataError(f"{path}: no {cfg.text_key!r} column (columns: {', '.join(pf.schema_arrow.names)}); "
                        "set data.text_key to the text column")
    for i in range(pf.num_row_groups):
        for text in pf.read_row_group(i, columns=[cfg.text_key]).column(0).to_pylist():
            if isinstance(text, str):
                yield text
            else:
                stats.skipped_bad_json += 1  # a null or non-string cell: counted with malformed records
                stats._note(stats.bad_json_examples, f"{path}: row group {i}")


def _iter_builtin_python(cfg: DataConfig, stats: SourceStats) -> Iterator[str]:
    """The pydoc topics (one document each), then the stdlib's .py files (one document each)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data; the stdlib source is still there
        topics = {}
    for name in sorted(topics):
        yield topics[name]
    for path in python_stdlib_files():
        yield from _iter_file(path, cfg, stats)


def python_stdlib_files() -> list[Path]:
    """The stdlib .py files read by builtin:python, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in walk_files(root, _STDLIB_SKIP_DIRS)
            if p.suffix == ".py" and not p.name.startswith("_sysconfigdata")]


def builtin_python_identity() -> dict:
    """What decides the content of builtin:python (for fingerprints)."""
    return {"source": BUILTIN_PYTHON, "python": sys.version, "stdlib": sysconfig.get_paths()["stdlib"]}
