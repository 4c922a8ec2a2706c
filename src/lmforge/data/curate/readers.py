"""Documents from `curate.inputs`, planned into deterministic work units and read back range by range.

Planning (`plan_units`) lists every input file in a fixed order (sorted walks) and counts its record
*slots* cheaply: one per .txt/.md file, one per JSONL line, one per Parquet/Arrow row. Units are runs of
`docs_per_shard` consecutive slots, so the same inputs always give the same units, and a big file is
split into record ranges. Reading (`read_unit`) streams one unit's ranges and checks the input as it
goes: non-UTF-8 bytes, binary files, empty documents, broken JSON lines, records without the text key
and over-long lines are skipped and counted (`BadInput`), or raise a DataError naming file:line.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.data.curate.doc import Doc
from lmforge.data.sources import BUILTIN_PYTHON, python_stdlib_files, special_kind, walk_files
from lmforge.errors import DataError

HF_PREFIX = "hf:"
TEXT_EXTENSIONS = (".txt", ".md")
READ_EXTENSIONS = TEXT_EXTENSIONS + (".jsonl", ".parquet")
BAD_KINDS = ("bad_utf8", "binary", "empty", "bad_json", "missing_text", "long_line")
_FIXES = {
    "bad_utf8": "re-encode the file as UTF-8 or remove it",
    "binary": "remove binary files from text folders",
    "empty": "remove empty documents",
    "bad_json": "fix the line (one JSON object per line)",
    "missing_text": "set curate.text_key to the records' text field",
    "long_line": "split the line or raise curate.max_line_chars",
}


@dataclass
class BadInput:
    """Skipped input items by kind, with a few `path:line` examples per kind (mergeable across units)."""

    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    ignored_files: int = 0  # files in input folders whose extension is not read
    max_examples: int = 3

    def note(self, kind: str, where: str, problem: str, on_bad: str) -> None:
        """Count one bad item, or raise when `on_bad` is "fail"."""
        assert kind in BAD_KINDS, kind
        if on_bad == "fail":
            raise DataError(f"{where}: {problem}; {_FIXES[kind]}, or set curate.on_bad_input=skip")
        self.counts[kind] += 1
        ex = self.examples.setdefault(kind, [])
        if len(ex) < self.max_examples:
            ex.append(where)

    def merge(self, other: BadInput) -> None:
        self.counts.update(other.counts)
        self.ignored_files += other.ignored_files
        for kind, ex in other.examples.items():
            mine = self.examples.setdefault(kind, [])
            mine.extend(ex[: max(0, self.max_examples - len(mine))])

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "examples": self.examples, "ignored_files": self.ignored_files,
                "total": self.total}

    @classmethod
    def from_dict(cls, d: dict[str, Any], max_examples: int = 3) -> BadInput:
        return cls(Counter(d["counts"]), {k: list(v) for k, v in d["examples"].items()},
                   d.get("ignored_files", 0), max_examples)


@dataclass
class Piece:
    """Record slots [start, stop) of one input: a file, an Arrow file of a saved dataset, or builtin
    text. `kind` is one of text | jsonl | parquet | arrow | topics; `paths` lists files for kind text
    (one document per file, `start`/`stop` index into it)."""

    kind: str
    path: str
    start: int
    stop: int
    source: str
    paths: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": self.kind, "path": self.path, "start": self.start, "stop": self.stop,
             "source": self.source}
        if self.paths is not None:
            d["paths"] = self.paths
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Piece:
        return cls(d["kind"], d["path"], d["start"], d["stop"], d["source"], d.get("paths"))

    def split(self, start: int, stop: int) -> Piece:
        paths = self.paths[start - self.start: stop - self.start] if self.paths is not None else None
        return Piece(self.kind, self.path, start, stop, self.source, paths)


# ---- planning -------------------------------------------------------------------------------------


def check_inputs(inputs: list[str]) -> None:
    """DataError for a missing input, or one that is neither a file nor a folder, before reading any."""
    if not inputs:
        raise DataError("curate.inputs is empty; give folders, files, 'hf:<dir>' or 'builtin:python'")
    for src in inputs:
        if src == BUILTIN_PYTHON:
            continue
        path = Path(src[len(HF_PREFIX):] if src.startswith(HF_PREFIX) else src)
        if not path.exists():
            raise DataError(f"curate input {src!r} does not exist (resolved: {path.resolve()}); give a "
                            f"folder, a file, 'hf:<dir saved with save_to_disk>' or {BUILTIN_PYTHON!r}")
        kind = special_kind(path)
        if kind is not None:  # /dev/zero would be read forever, a FIFO would block
            raise DataError(f"curate input {src!r} is {kind}, not a regular file or a folder; give a folder, "
                            f"a file, 'hf:<dir saved with save_to_disk>' or {BUILTIN_PYTHON!r}")


def plan_pieces(inputs: list[str], text_key: str = "text") -> tuple[list[Piece], int]:
    """Every input as whole-file pieces in a fixed order, and the number of ignored files."""
    check_inputs(inputs)
    pieces: list[Piece] = []
    ignored = 0
    specials: list[Path] = []  # FIFOs, devices, broken links in folders: never opened, counted as ignored
    for src in inputs:
        if src == BUILTIN_PYTHON:
            n = len(_pydoc_topics())
            if n:
                pieces.append(Piece("topics", BUILTIN_PYTHON, 0, n, src))
            files = [str(p) for p in python_stdlib_files()]
            _add_text_files(pieces, files, src)
        elif src.startswith(HF_PREFIX):
            for f in hf_arrow_files(Path(src[len(HF_PREFIX):])):
                pieces.append(Piece("arrow", str(f), 0, _arrow_rows(f), src))
        elif Path(src).is_dir():
            texts: list[str] = []
            for f in walk_files(Path(src), on_skip=lambda path, what: specials.append(path)):
                ext = f.suffix.lower()
                if ext in TEXT_EXTENSIONS:
                    texts.append(str(f))
                    continue
                _add_text_files(pieces, texts, src)
                texts = []
                if ext in READ_EXTENSIONS:
                    pieces.append(_file_piece(f, src))
                else:
                    ignored += 1
            _add_text_files(pieces, texts, src)
        else:
            p = Path(src)
            if p.suffix.lower() in (".jsonl", ".parquet"):
                pieces.append(_file_piece(p, src))
            else:  # a file named explicitly is read as text whatever its extension
                _add_text_files(pieces, [str(p)], src)
    return pieces, ignored + len(specials)


def plan_units(pieces: list[Piece], docs_per_shard: int) -> list[list[Piece]]:
    """Consecutive runs of `docs_per_shard` record slots (the last unit may be shorter)."""
    units: list[list[Piece]] = []
    cur: list[Piece] = []
    room = docs_per_shard
    for piece in pieces:
        pos = piece.start
        while pos < piece.stop:
            take = min(room, piece.stop - pos)
            cur.append(piece.split(pos, pos + take))
            pos += take
            room -= take
            if room == 0:
                units.append(cur)
                cur, room = [], docs_per_shard
    if cur:
        units.append(cur)
    return units


def _add_text_files(pieces: list[Piece], files: list[str], source: str) -> None:
    if files:
        pieces.append(Piece("text", files[0], 0, len(files), source, list(files)))


def _file_piece(path: Path, source: str) -> Piece:
    if path.suffix.lower() == ".parquet":
        return Piece("parquet", str(path), 0, _parquet_rows(path), source)
    return Piece("jsonl", str(path), 0, _count_lines(path), source)


def _count_lines(path: Path) -> int:
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError("reading .parquet files and 'hf:' datasets needs pyarrow; "
                        "pip install pyarrow (or the lmforge 'data' extra)") from None
    return pyarrow


def _parquet_rows(path: Path) -> int:
    pa = _pyarrow()
    try:
        return pa.parquet.ParquetFile(path).metadata.num_rows
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e}); remove or repair it") from None


def hf_arrow_files(root: Path) -> list[Path]:
    """The Arrow files of a dataset (or each split of a DatasetDict) written by `save_to_disk`."""
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text())["splits"]
        return [f for s in splits for f in hf_arrow_files(root / s)]
    state = root / "state.json"
    if state.is_file():
        return [root / d["filename"] for d in json.loads(state.read_text())["_data_files"]]
    files = sorted(root.glob("*.arrow"))
    if not files:
        raise DataError(f"hf:{root} holds no state.json, dataset_dict.json or .arrow files; give a dir "
                        "written by datasets' save_to_disk")
    return files


def _open_arrow(path: Path):
    """A record-batch reader over a saved dataset's Arrow file (stream format, else file format)."""
    pa = _pyarrow()
    src = pa.memory_map(str(path), "r")
    try:
        return pa.ipc.open_stream(src)
    except pa.ArrowInvalid:
        f = pa.ipc.open_file(src)
        return iter(f.get_batch(i) for i in range(f.num_record_batches))


def _arrow_rows(path: Path) -> int:
    return sum(b.num_rows for b in _open_arrow(path))


def _pydoc_topics() -> dict[str, str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return {}
    return topics


# ---- reading --------------------------------------------------------------------------------------


class Reader:
    """Reads units' pieces into `Doc`s, checking the input per `on_bad_input` / `max_line_chars`."""

    def __init__(self, text_key: str, id_key: str, on_bad: str, max_line_chars: int,
                 bad: BadInput | None = None) -> None:
        self.text_key, self.id_key = text_key, id_key
        self.on_bad, self.max_line_chars = on_bad, max_line_chars
        self.bad = bad if bad is not None else BadInput()

    def read_unit(self, pieces: list[Piece]) -> Iterator[Doc]:
        for piece in pieces:
            yield from self.read_piece(piece)

    def read_piece(self, piece: Piece) -> Iterator[Doc]:
        read = {"text": self._text_files, "jsonl": self._jsonl, "parquet": self._parquet,
                "arrow": self._arrow, "topics": self._topics}[piece.kind]
        yield from read(piece)

    def _doc(self, doc_id: str, text: str, where: str, source: str, meta: dict | None = None) -> Doc | None:
        """The Doc, or None after noting an empty document or an over-long line."""
        if not text.strip():
            self.bad.note("empty", where, "empty document", self.on_bad)
            return None
        if len(text) > self.max_line_chars:
            longest = max(map(len, text.split("\n")))
            if longest > self.max_line_chars:
                self.bad.note("long_line", where, f"a line of {longest:,} chars is longer than "
                              f"curate.max_line_chars={self.max_line_chars:,}", self.on_bad)
                return None
        return Doc(doc_id, text, {"source": source, **(meta or {})})

    def _text_files(self, piece: Piece) -> Iterator[Doc]:
        assert piece.paths is not None
        for path in piece.paths:
            data = Path(path).read_bytes()
            if b"\x00" in data:
                line = data[: data.index(b"\x00")].count(b"\n") + 1
                self.bad.note("binary", f"{path}:{line}", "NUL byte: a binary file, not text", self.on_bad)
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                line = data[: e.start].count(b"\n") + 1
                self.bad.note("bad_utf8", f"{path}:{line}", f"not valid UTF-8 at byte offset {e.start} "
                              f"({e.reason})", self.on_bad)
                continue
            doc = self._doc(path, text, f"{path}:1", piece.source)
            if doc is not None:
                yield doc

    def _jsonl(self, piece: Piece) -> Iterator[Doc]:
        path = piece.path
        with open(path, "rb") as f:
            for index, raw in enumerate(f):
                if index < piece.start:
                    continue
                if index >= piece.stop:
                    break
                lineno = index + 1
                where = f"{path}:{lineno}"
                if len(raw) > self.max_line_chars + 2 and len(raw.rstrip(b"\r\n")) > self.max_line_chars:
                    self.bad.note("long_line", where, f"a line of {len(raw):,} bytes is longer than "
                                  f"curate.max_line_chars={self.max_line_chars:,}", self.on_bad)
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    self.bad.note("bad_utf8", where, f"not valid UTF-8 at column {e.start + 1} ({e.reason})",
                                  self.on_bad)
                    continue
                if not line.strip():
                    continue  # blank lines are allowed in JSONL (a trailing newline, say)
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    self.bad.note("bad_json", where, f"malformed JSON ({e.msg} at column {e.colno})",
                                  self.on_bad)
                    continue
                doc = self._record(record, f"{path}:{lineno}", where, piece.source)
                if doc is not None:
                    yield doc

    def _record(self, record: Any, default_id: str, where: str, source: str) -> Doc | None:
        if not isinstance(record, dict):
            self.bad.note("bad_json", where, f"a JSON {type(record).__name__}, not an object", self.on_bad)
            return None
        text = record.get(self.text_key)
        if not isinstance(text, str):
            what = "no" if text is None else f"a {type(text).__name__} in its"
            self.bad.note("missing_text", where, f"record has {what} {self.text_key!r} field (keys: "
                          f"{', '.join(sorted(map(str, record))[:8]) or 'none'})", self.on_bad)
            return None
        rid = record.get(self.id_key)
        doc_id = default_id if rid is None or isinstance(rid, (dict, list)) else str(rid)
        extra = {k: v for k, v in record.items() if k not in (self.text_key, self.id_key, "source")}
        return self._doc(doc_id, text, where, source, {"meta": extra} if extra else None)

    def _batches(self, batches, piece: Piece) -> Iterator[Doc]:
        """Docs of rows [piece.start, piece.stop) of an iterator of record batches / tables."""
        row = 0
        for batch in batches:
            n = batch.num_rows
            if row + n <= piece.start:
                row += n
                continue
            if row >= piece.stop:
                break
            lo, hi = max(piece.start - row, 0), min(piece.stop - row, n)
            names = batch.schema.names
            if self.text_key not in names:
                for r in range(row + lo, row + hi):
                    self.bad.note("missing_text", f"{piece.path}:{r}", f"no {self.text_key!r} column "
                                  f"(columns: {', '.join(names[:8])})", self.on_bad)
                row += n
                continue
            texts = batch.column(names.index(self.text_key)).slice(lo, hi - lo).to_pylist()
            ids = (batch.column(names.index(self.id_key)).slice(lo, hi - lo).to_pylist()
                   if self.id_key in names else [None] * len(texts))
            for k, (text, rid) in enumerate(zip(texts, ids)):
                r = row + lo + k
                doc = self._record({self.text_key: text, self.id_key: rid}, f"{piece.path}:{r}",
                                   f"{piece.path}:{r}", piece.source)
                if doc is not None:
                    yield doc
            row += n

    def _parquet(self, piece: Piece) -> Iterator[Doc]:
        pa = _pyarrow()
        pf = pa.parquet.ParquetFile(piece.path)
        cols = [c for c in (self.text_key, self.id_key) if c in pf.schema_arrow.names]
        groups = (pf.read_row_group(i, columns=cols) for i in range(pf.num_row_groups))
        if not cols:  # keep the row count so every row is reported as missing its text
            groups = (pf.read_row_group(i) for i in range(pf.num_row_groups))
        yield from self._batches(groups, piece)

    def _arrow(self, piece: Piece) -> Iterator[Doc]:
        yield from self._batches(_open_arrow(Path(piece.path)), piece)

    def _topics(self, piece: Piece) -> Iterator[Doc]:
        topics = _pydoc_topics()
        for name in sorted(topics)[piece.start: piece.stop]:
            doc = self._doc(f"{BUILTIN_PYTHON}:topics/{name}", topics[name], f"pydoc topic {name}",
                            piece.source)
            if doc is not None:
                yield doc
