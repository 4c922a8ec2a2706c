"""Documents from `data.sources`: files, folders, JSONL files and the text that ships with Python.

Everything streams: one document is in memory at a time, and the order is fixed (sorted walks) so two
runs over the same sources yield the same documents in the same order. Only regular files are ever
opened: a device (/dev/zero), FIFO or socket would be read forever or block, so naming one is an error
and a folder walk skips them (and links to them, dangling links and links that loop back).
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import sysconfig
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

from lmforge.config.schema import DataConfig
from lmforge.errors import DataError
from lmforge.utils.jsontext import BadJSON, loads

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
    skipped_not_regular: int = 0  # FIFOs, devices, sockets, dangling or looping links in folders
    bad_utf8_examples: list[str] = field(default_factory=list)
    bad_json_examples: list[str] = field(default_factory=list)
    not_regular_examples: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the console: what was read and every non-zero skip count."""
        parts = [f"{self.documents:,} documents", f"{self.chars:,} chars", f"{self.files:,} files"]
        for name, n, examples in (
            ("empty", self.skipped_empty, []),
            ("bad UTF-8", self.skipped_bad_utf8, self.bad_utf8_examples),
            ("bad JSON", self.skipped_bad_json, self.bad_json_examples),
            ("other extension", self.skipped_other_ext, []),
            ("non-regular", self.skipped_not_regular, self.not_regular_examples),
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

    def _not_regular(self, path: Path, what: str) -> None:
        self.skipped_not_regular += 1
        self._note(self.not_regular_examples, f"{path}: {what}")


def iter_documents(cfg: DataConfig, stats: SourceStats) -> Iterator[str]:
    """Yield every document of `cfg.sources` in a fixed order, updating `stats` as it goes.

    Stops once `cfg.max_chars` characters were yielded (the last document is cut to fit exactly).
    Raises DataError for a missing path or one that is not a file or folder, for a file that cannot
    be read, and for bad UTF-8 / bad JSON when the matching `on_bad_*` setting is "fail".
    """
    for src in cfg.source_paths:  # fail on a bad path before yielding anything
        check_source(src)
    budget = cfg.max_chars
    keep = None  # max_chars_from=spread: which documents, evenly over every source
    if budget is not None and cfg.max_chars_from == "spread":
        total = sum(source_size(src) for src in cfg.source_paths)
        keep = Spread((budget - stats.chars) / total) if total else None
    for src in cfg.source_paths:
        stats.sources.append(src)
        for doc in _iter_source(src, cfg, stats):
            if not doc or doc.isspace():  # as `not doc.strip()`, without copying a huge document
                stats.skipped_empty += 1
                continue
            if keep is not None and not keep(len(doc)):
                continue
            if budget is not None and len(doc) >= budget - stats.chars:
                doc = doc[: budget - stats.chars]
                stats.truncated = True
                if not doc or doc.isspace():
                    return
            stats.documents += 1
            stats.chars += len(doc)
            yield doc
            if stats.truncated:
                return


class Spread:
    """Keeps a share `rate` of a stream of documents, spread evenly over it: a document is kept while the
    characters kept, with it, stay within `rate` of the characters seen (Bresenham's rule on characters;
    deterministic, one pass, no total needed beyond the rate)."""

    def __init__(self, rate: float) -> None:
        self.rate, self.seen, self.kept = rate, 0, 0

    def __call__(self, chars: int) -> bool:
        self.seen += chars
        if self.kept + chars / 2 > self.rate * self.seen:
            return False
        self.kept += chars
        return True


def source_size(src: str) -> int:
    """Bytes `src` holds (builtin:python: its documents' characters and files' bytes; a folder: the files
    a walk would read): what max_chars_from=spread spreads over, and what preparing it reads."""
    if src == BUILTIN_PYTHON:
        try:
            from pydoc_data.topics import topics
        except ImportError:
            topics = {}
        return sum(len(t) for t in topics.values()) + sum(p.stat().st_size for p in python_stdlib_files())
    path = Path(src)
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in walk_files(path)
               if f.suffix.lower() in TEXT_EXTENSIONS + JSONL_EXTENSIONS + PARQUET_EXTENSIONS)


def check_source(src: str) -> None:
    """DataError unless `src` is builtin:python, a folder or a regular file (links are followed)."""
    if src == BUILTIN_PYTHON:
        return
    path = Path(src)
    hint = f"give a file, a folder or {BUILTIN_PYTHON!r}"
    try:
        kind = special_kind(path)
    except FileNotFoundError:
        raise DataError(f"data source {src!r} does not exist (resolved: {path.resolve()}); {hint}") from None
    except OSError as e:  # a link loop, a folder on the way that cannot be searched
        raise DataError(f"data source {src!r} cannot be opened ({e.strerror}); {hint}") from None
    if kind is not None:
        raise DataError(f"data source {src!r} is {kind}, not a regular file or a folder: reading it would "
                        f"never end or would block; {hint}")


def special_kind(path: Path) -> str | None:
    """What `path` is ("a FIFO (named pipe)", ...) unless a regular file or a folder (then None).

    Links are followed; OSError when `path` cannot be looked at (FileNotFoundError when missing).
    """
    mode = os.stat(path).st_mode
    return None if stat.S_ISDIR(mode) or stat.S_ISREG(mode) else _file_kind(mode)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def _iter_source(src: str, cfg: DataConfig, stats: SourceStats) -> Iterator[str]:
    if src == BUILTIN_PYTHON:
        yield from _iter_builtin_python(cfg, stats)
        return
    path = Path(src)
    if path.is_dir():
        for f in walk_files(path, on_skip=stats._not_regular):
            if f.suffix.lower() in TEXT_EXTENSIONS + JSONL_EXTENSIONS + PARQUET_EXTENSIONS:
                yield from _iter_file(f, cfg, stats)
            else:
                stats.skipped_other_ext += 1
    else:
        yield from _iter_file(path, cfg, stats)  # a file named explicitly is read whatever its extension


def walk_files(root: Path, skip_dirs: Collection[str] = (),
               on_skip: Callable[[Path, str], object] | None = None) -> Iterator[Path]:
    """Regular files under `root` in sorted path order, hidden entries (.git, editor temp files) left out.

    Links are followed. Whatever is not a regular file or a folder (FIFO, device, socket, dangling
    link) and links back to a folder above (a loop) are never opened: `on_skip(path, what)` hears
    of each. Raises DataError for a folder that cannot be listed.
    """
    try:
        top = os.stat(root)
    except OSError as e:
        raise DataError(f"cannot open folder {root} ({e.strerror}); make it readable or leave it "
                        "out") from None
    yield from _walk(Path(root), skip_dirs, on_skip, frozenset({(top.st_dev, top.st_ino)}))


def _walk(dir: Path, skip_dirs: Collection[str], on_skip: Callable[[Path, str], object] | None,
          above: frozenset[tuple[int, int]]) -> Iterator[Path]:
    """`walk_files` below `dir`; `above` holds (device, inode) of `dir` and every folder above it."""
    try:
        with os.scandir(dir) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as e:  # no permission, or removed since its parent was listed
        raise DataError(f"cannot list folder {dir} ({e.strerror}); make it readable or move it out of "
                        "the data source") from None
    skip = on_skip or (lambda path, what: None)
    for e in entries:
        if e.name.startswith("."):
            continue
        path = Path(e.path)
        try:  # both follow links; is_file() of a plain entry needs no system call
            st = None if e.is_file() else e.stat()
        except OSError as err:  # dangling link, link loop, or gone since the listing
            skip(path, "a link loop" if err.errno == errno.ELOOP else
                 "a dangling link" if isinstance(err, FileNotFoundError) and e.is_symlink() else
                 f"cannot be opened: {err.strerror}")
            continue
        if st is None:
            yield path
        elif stat.S_ISDIR(st.st_mode):
            if e.name in skip_dirs:
                continue
            key = (st.st_dev, st.st_ino)
            if key in above:
                skip(path, "a link back to a folder above it")
                continue
            yield from _walk(path, skip_dirs, on_skip, above | {key})
        else:
            skip(path, _file_kind(st.st_mode))


def _iter_file(path: Path, cfg: DataConfig, stats: SourceStats) -> Iterator[str]:
    if path.suffix.lower() in JSONL_EXTENSIONS:
        yield from _iter_jsonl(path, cfg, stats)
        return
    if path.suffix.lower() in PARQUET_EXTENSIONS:
        yield from _iter_parquet(path, cfg, stats)
        return
    try:
        with _open_regular(path) as f:
            data = f.read()
    except OSError as e:
        raise _unreadable(path, e) from None
    text = _decode(data, str(path), 0, cfg, stats)
    del data  # the bytes are not needed while the text is being used
    stats.files += 1
    if text is not None:
        yield text


def _open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading; OSError unless it is a regular file.

    The check is on the opened file itself, so a file swapped for a FIFO since the walk saw it cannot
    block (O_NONBLOCK makes opening a FIFO return at once; it changes nothing for regular files).
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(f"it is {_file_kind(mode)}, not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _unreadable(path: Path, e: OSError) -> DataError:
    why = "it disappeared while being read" if isinstance(e, FileNotFoundError) else (e.strerror or str(e))
    return DataError(f"cannot read {path}: {why}; make it a readable file or move it out of data.sources")


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
    offset = lineno = 0
    try:  # only the file raises OSError here (a consumer's exceptions never enter this generator)
        with _open_regular(path) as f:
            while raw := f.readline():  # not enumerate(f): it keeps the last line alive
                lineno += 1
                start, offset = offset, offset + len(raw)
                text = _jsonl_text(raw, f"{path}:{lineno}", start, cfg, stats)
                del raw  # while a huge line's text is in use, its bytes need not be
                if text is not None:
                    yield text
    except OSError as e:
        raise _unreadable(path, e) from None


def _jsonl_text(raw: bytes, where: str, start: int, cfg: DataConfig, stats: SourceStats) -> str | None:
    """The text of one JSONL line; None for a blank line, or a bad one when on_bad_* is "skip"."""
    line = _decode(raw, where, start, cfg, stats)
    if not line or line.isspace():
        return None  # blank lines are allowed in JSONL files (a trailing newline, say)
    try:
        record = loads(line)
    except BadJSON as e:  # malformed, nested past the recursion limit, or lone surrogates
        return _bad_json(where, e.why, cfg, stats)
    if not isinstance(record, dict) or cfg.text_key not in record:
        return _bad_json(where, f"record has no {cfg.text_key!r} key (set data.text_key to the text field)",
                         cfg, stats)
    if not isinstance(record[cfg.text_key], str):
        return _bad_json(where, f"{cfg.text_key!r} is a {type(record[cfg.text_key]).__name__}, not a string",
                         cfg, stats)
    return record[cfg.text_key]


def _bad_json(where: str, problem: str, cfg: DataConfig, stats: SourceStats) -> None:
    if cfg.on_bad_json == "fail":
        raise DataError(f"{where}: {problem}; fix the line or set data.on_bad_json=skip")
    stats.skipped_bad_json += 1
    stats._note(stats.bad_json_examples, where)


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
