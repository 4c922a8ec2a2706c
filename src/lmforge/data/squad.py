"""SQuAD-like questions (objective qa): records -> a prepared data dir of question + context windows with
their answer spans as token positions, and the loader of its batches.

    {"context": "...", "question": "...", "answers": {"text": ["Denver Broncos"], "answer_start": [177]}}

(field names: qa.context_field / question_field / answers_field; `answer_start` are character offsets
into the context, and each must point at its text there). Every record has at least one answer; the
first is trained on, all count when the report scores a prediction (SQuAD v1.1).

A window is the question, then a stretch of the context: a decoder reads `question "\\n" context` (the
question first, so that every context token has seen it), an encoder `[CLS] question [SEP] context [SEP]`
with token type 1 on the context. A context longer than a window is read in overlapping windows
(qa.doc_stride tokens shared by consecutive ones, at most qa.max_windows of them: transformers' run_qa
with return_overflowing_tokens; the question is cut to half of train.seq_len). A window's start / end
targets are the positions of the first answer's first and last tokens (the tokens whose character spans
hold the answer's first and last characters); a window that does not hold the whole answer points both at
position 0, as run_qa points them at [CLS].

The dir holds per split the windows' ids, where each window's context starts ("second"), the targets, the
record each window reads (`example`) and each token's character span in its context (-1 outside the
context), plus `<split>_examples.jsonl` (each record's context and gold answers) for the report.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.data.batch import PaddedRows
from lmforge.data.chat import BadRow, ChatStats, iter_records
from lmforge.data.sources import check_source
from lmforge.data.task_data import Built, TaskLoader, prepare_dir, settings_of, split_records, tokenizer_file
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import ConfigError, DataError

KIND = "spans"
MAX_CONTEXT_CHARS = 1 << 20  # a record's context (at most qa.max_windows windows of it are read)
MAX_QUESTION_CHARS = 10_000
MAX_ANSWERS = 100


@dataclass(frozen=True)
class QARecord:
    context: str
    question: str
    answers: tuple[str, ...]
    starts: tuple[int, ...]
    where: str  # file:line


def _text(record: dict, key: str, name: str, where: str, limit: int) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        got = "missing" if key not in record else f"{type(value).__name__} {str(value)[:40]!r}"
        keys = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise DataError(f"{where}: field {key!r} must be a non-empty string, got {got} (keys: {keys}); "
                        f"qa.{name} names it")
    if len(value) > limit:
        raise DataError(f"{where}: field {key!r} has {len(value):,} characters (at most {limit:,})")
    return value


def parse_qa(record: Any, where: str, c: Any) -> QARecord:
    """One record's context, question and answers (`c`: the qa section), or DataError naming `where`."""
    if isinstance(record, BadRow):
        raise DataError(f"{where}: {record.why}")
    if not isinstance(record, dict):
        raise DataError(f"{where}: a question record must be a JSON object, got {type(record).__name__}")
    context = _text(record, c.context_field, "context_field", where, MAX_CONTEXT_CHARS)
    question = _text(record, c.question_field, "question_field", where, MAX_QUESTION_CHARS)
    answers = record.get(c.answers_field)
    texts = answers.get("text") if isinstance(answers, dict) else None
    starts = answers.get("answer_start") if isinstance(answers, dict) else None
    texts, starts = (v.tolist() if hasattr(v, "tolist") else v for v in (texts, starts))
    if not isinstance(texts, list) or not isinstance(starts, list) or not texts or len(texts) != len(starts):
        raise DataError(f"{where}: field {c.answers_field!r} must be {{\"text\": [...], \"answer_start\": "
                        f"[...]}} with as many starts as texts, at least one (got {str(answers)[:80]!r}); "
                        "qa.answers_field names it")
    if len(texts) > MAX_ANSWERS:
        raise DataError(f"{where}: {len(texts)} answers (at most {MAX_ANSWERS})")
    for i, (text, start) in enumerate(zip(texts, starts)):
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: answer {i} {str(text)[:40]!r} must be a non-empty string")
        number = isinstance(start, int) and not isinstance(start, bool)
        if not number or not 0 <= start <= len(context) - len(text) or not context.startswith(text, start):
            at = context[start:start + len(text)] if number else None
            raise DataError(f"{where}: answer {i} {text[:40]!r}: answer_start {start!r} does not point at it "
                            f"in the context (the context there reads {str(at)[:40]!r}); answer_start is the "
                            "character offset of the answer in the context")
    return QARecord(context, question, tuple(texts), tuple(starts), where)


def read_qa(sources: list[str], c: Any) -> Iterator[QARecord]:
    stats = ChatStats()
    for src in sources:
        check_source(src)
    for src in sources:
        for _, records in iter_records(Path(src), stats):
            for where, record in records:
                yield parse_qa(record, where, c)


@dataclass
class Window:
    ids: list[int]
    second: int  # where the context starts
    start: int  # target positions (0, 0: the answer is not in this window)
    end: int
    spans: list[tuple[int, int]]  # each token's character span in the context, (-1, -1) outside it


def windows(tok: Tokenizer, r: QARecord, c: Any, seq_len: int, encoder: dict[str, int] | None
            ) -> tuple[list[Window], bool]:
    """The record's windows and whether its context (or question) was cut."""
    question = tok.encode(r.question + ("" if encoder else "\n"))
    cut = len(question) > seq_len // 2
    question = question[: seq_len // 2]
    prefix = [encoder["cls"], *question, encoder["sep"]] if encoder else question
    room = seq_len - len(prefix) - (1 if encoder else 0)
    if room <= c.doc_stride:
        raise ConfigError(f"train.seq_len={seq_len} leaves {room} tokens of context after the question "
                          f"({r.where}), not more than qa.doc_stride={c.doc_stride}: raise train.seq_len or "
                          "lower qa.doc_stride")
    enc = tok.hf.encode(r.context, add_special_tokens=False)
    ids, offsets = enc.ids, enc.offsets
    s_char, e_char = r.starts[0], r.starts[0] + len(r.answers[0])
    first = next((i for i, (a, b) in enumerate(offsets) if b > s_char), None)
    last = next((i for i in range(len(offsets) - 1, -1, -1) if offsets[i][0] < e_char), None)
    out, begin = [], 0
    while True:
        stop = min(begin + room, len(ids))
        inside = first is not None and last is not None and begin <= first and last < stop
        start = len(prefix) + first - begin if inside else 0
        end = len(prefix) + last - begin if inside else 0
        tail = [encoder["sep"]] if encoder else []
        spans = [(-1, -1)] * len(prefix) + [tuple(o) for o in offsets[begin:stop]] + [(-1, -1)] * len(tail)
        out.append(Window([*prefix, *ids[begin:stop], *tail], len(prefix), start, end, spans))
        if stop == len(ids):
            return out, cut
        if len(out) == c.max_windows:
            return out, True
        begin = stop - c.doc_stride


def prepare(cfg: Any, console=print, replace: bool = False):
    """Prepare (or reuse) the qa section's questions in the run's data dir."""
    c = cfg.qa
    if not c.data:
        raise DataError("objective qa needs question records: set qa.data to .jsonl / .parquet files "
                        "(`lmforge tasks --qa FILE` writes a shipped set)")
    tok_file = tokenizer_file(cfg, cfg.objective.name)
    tok = Tokenizer.load(tok_file)
    encoder = tok.encoder_ids() if cfg.model.arch == "encoder" else None
    if cfg.model.arch == "encoder" and encoder is None:
        raise DataError(f"{tok_file}: an encoder reads [CLS] question [SEP] context [SEP], and this "
                        "tokenizer has no [CLS] / [SEP] (or <s> / </s>): use the tokenizer of the encoder's "
                        "own run")

    def build() -> Built:
        records = split_records(lambda paths: read_qa(paths, c), c, "qa.data", cfg.run.seed)
        splits, counts, files = {}, {}, {}
        for name, recs in records.items():
            wins, example, cut = [], [], 0
            for k, r in enumerate(recs):
                ws, was_cut = windows(tok, r, c, cfg.seq_len, encoder)
                wins += ws
                example += [k] * len(ws)
                cut += was_cut
            lengths = np.asarray([len(w.ids) for w in wins], dtype=np.int64)
            spans = np.asarray([s for w in wins for s in w.spans], dtype=np.int64).reshape(-1, 2)
            splits[name] = {
                "ids": np.asarray([t for w in wins for t in w.ids], dtype=np.int32),
                "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                "second": np.asarray([w.second for w in wins], dtype=np.int64),
                "start": np.asarray([w.start for w in wins], dtype=np.int64),
                "end": np.asarray([w.end for w in wins], dtype=np.int64),
                "example": np.asarray(example, dtype=np.int64),
                "char_start": spans[:, 0].copy(), "char_end": spans[:, 1].copy()}
            counts[name] = {"examples": len(recs), "windows": len(wins), "tokens": int(lengths.sum()),
                            "answerable windows": int(sum(w.end > 0 for w in wins)), "truncated": cut}
            files[f"{name}_examples.jsonl"] = "".join(
                json.dumps({"context": r.context, "answers": list(r.answers)}) + "\n" for r in recs)
        return Built(splits, counts, [], {"max_answer_tokens": c.max_answer_tokens}, files)

    return prepare_dir(cfg, KIND, settings_of(c, cfg, tok_file, KIND), tok, build, console, replace)


def read_examples(dir: Path, split: str) -> list[dict]:
    """Each record's context and gold answers of a prepared split (the report's reference)."""
    text = (Path(dir) / f"{split}_examples.jsonl").read_text("utf-8")
    return [json.loads(line) for line in text.splitlines()]


# -- batches ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpanBatch(PaddedRows):
    """`input_ids` (B, T) right-padded windows, `lengths` (B,), `start` / `end` (B,) target positions (0:
    the answer is not in the window), `token_types` (B, T): 1 on the context (an encoder's segment ids)."""

    input_ids: torch.Tensor
    lengths: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    real_tokens: int = 0
    token_types: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SpanBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return SpanBatch(move(self.input_ids), move(self.lengths), move(self.start), move(self.end),
                         self.real_tokens, move(self.token_types))

    @property
    def examples(self) -> int:
        return self.start.numel()


class SpanLoader(TaskLoader):
    """`SpanBatch`es of one split's windows."""

    kind = "SpanLoader"

    def collate(self, rows: np.ndarray) -> SpanBatch:
        lengths = np.asarray([int(self.split.lengths[int(i)]) for i in rows], dtype=np.int64)
        ids = self.padded(rows, "ids", self.pad_id)
        second = np.asarray([int(self.split.second[int(i)]) for i in rows], dtype=np.int64)
        pos = np.arange(ids.shape[1])[None]
        types = ((pos >= second[:, None]) & (pos < lengths[:, None])).astype(np.int64)
        pick = lambda name: torch.from_numpy(np.asarray([self.split.arrays[name][int(i)] for i in rows],  # noqa: E731
                                                        dtype=np.int64))
        return SpanBatch(torch.from_numpy(ids), torch.from_numpy(lengths), pick("start"), pick("end"),
                         int(lengths.sum()), torch.from_numpy(types))
