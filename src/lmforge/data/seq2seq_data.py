"""Input -> target records of sequence-to-sequence fine-tuning (objective seq2seq, what `lmforge sft` trains
on an encoder-decoder): read, tokenized, prepared in the run's data dir (data/task_data.py's layout) and
batched as padded Seq2SeqBatches.

A record is either plain, {seq2seq.input_field: str, seq2seq.target_field: str}, or a chat record of any
shape `lmforge sft` reads (messages, prompt/completion, Alpaca, ShareGPT; `lmforge tasks` writes messages
records). A chat record maps to one input and one target, with no chat template (T5 reads plain text):

- the user's turn is the input, the assistant's reply the target;
- a system prompt before them goes before the user's text, separated by a blank line
  (seq2seq.system=prepend), or the record is refused (seq2seq.system=refuse);
- anything else (several user turns or replies, tool calls, a conversation not ending with the reply) is
  refused with its file:line: an encoder-decoder learns one input -> one output; write such data as plain
  records whose input holds the conversation as text.

Both sides are the text's tokens then EOS, as T5's tokenizer encodes (and `lmforge generate` feeds a T5
run). An input longer than train.seq_len, or a target longer than model.max_seq_len, keeps its start and
its EOS (seq2seq.overlong=truncate) or drops the record (drop); either is counted in what `prepare` says.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.data.batch import IGNORE_INDEX
from lmforge.data.chat import BadRecord, BadRow, ChatStats, iter_records, to_conversation
from lmforge.data.seq2seq import Seq2SeqBatch
from lmforge.data.sources import check_source
from lmforge.data.task_data import Built, TaskLoader, prepare_dir, settings_of, split_records, tokenizer_file
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import DataError

KIND = "text2text"  # the data kind (config/methods.py): input -> target texts
MAX_CHARS = 1 << 20  # one side of one record: bounds the tokenizer's work per record


@dataclass(frozen=True)
class Pair:
    input: str
    target: str
    where: str  # file:line


def _plain_text(record: dict, key: str, name: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        got = "missing" if key not in record else f"{type(value).__name__} {str(value)[:40]!r}"
        raise DataError(f"{where}: field {key!r} must be a non-empty string, got {got}; seq2seq.{name} names "
                        "it (a plain record has the input and target fields)")
    return value


def _chat_pair(record: dict, where: str, system: str, target: bool = True) -> tuple[str, str | None]:
    """(input, target) of a chat record: [system,] user, assistant (the module docstring); `target`
    False: the input only (the assistant's turn, if any, is not read)."""
    try:
        conv = to_conversation(record, where)
    except BadRecord as e:
        raise DataError(f"{where}: {e} (a seq2seq record is either plain, with seq2seq.input_field and "
                        "seq2seq.target_field, or a chat record)") from None
    msgs = list(conv.messages)
    roles = [m.get("role") for m in msgs]
    prefix = ""
    if roles[:1] == ["system"]:
        if system == "refuse":
            raise DataError(f"{where}: the record has a system prompt and seq2seq.system=refuse; drop it "
                            "from the data or set seq2seq.system=prepend (it goes before the user's text)")
        prefix = _content(msgs[0], where) + "\n\n"
        msgs, roles = msgs[1:], roles[1:]
    if not target and roles[-1:] == ["assistant"]:
        msgs, roles = msgs[:-1], roles[:-1]
    want = ["user", "assistant"] if target else ["user"]
    if roles != want or conv.tools or any(m.get("tool_calls") for m in msgs):
        turns = ", ".join(map(str, roles)) or "none"
        raise DataError(f"{where}: an encoder-decoder learns one input -> one target, and this record's "
                        f"turns are {turns}: give one user turn then one assistant reply (a system prompt "
                        "before them may stay), or write the conversation as a plain record "
                        "(seq2seq.input_field, seq2seq.target_field)")
    return prefix + _content(msgs[0], where), _content(msgs[1], where) if target else None


def _content(message: dict, where: str) -> str:
    text = message.get("content")
    if not isinstance(text, str) or not text.strip():
        raise DataError(f"{where}: the {message.get('role')} turn has no text (content "
                        f"{str(text)[:40]!r}); seq2seq reads plain text turns")
    return text


def parse_pair(record: Any, where: str, c: Any) -> Pair:
    """One record's input and target (`c`: the seq2seq section), or DataError naming `where`."""
    if isinstance(record, BadRow):
        raise DataError(f"{where}: {record.why}")
    if not isinstance(record, dict):
        raise DataError(f"{where}: a seq2seq record must be a JSON object, got {type(record).__name__}")
    if c.input_field in record or c.target_field in record:
        x = _plain_text(record, c.input_field, "input_field", where)
        y = _plain_text(record, c.target_field, "target_field", where)
    else:
        x, y = _chat_pair(record, where, c.system)
    for side, text in (("input", x), ("target", y)):
        if len(text) > MAX_CHARS:
            raise DataError(f"{where}: the {side} has {len(text):,} characters (at most {MAX_CHARS:,})")
    return Pair(x, y, where)


def input_text(record: Any, where: str, c: Any) -> str:
    """The input side of a record, as `parse_pair` reads it (evaluation: the answer is scored apart)."""
    if not isinstance(record, dict):
        return parse_pair(record, where, c).input  # its error
    if c.input_field in record or c.target_field in record:
        text = _plain_text(record, c.input_field, "input_field", where)
    else:
        text = _chat_pair(record, where, c.system, target=False)[0]
    if len(text) > MAX_CHARS:
        raise DataError(f"{where}: the input has {len(text):,} characters (at most {MAX_CHARS:,})")
    return text


def read_pairs(sources: list[str], c: Any) -> Iterator[Pair]:
    stats = ChatStats()
    for src in sources:
        check_source(src)
    for src in sources:
        for _, records in iter_records(Path(src), stats):
            for where, record in records:
                yield parse_pair(record, where, c)


def prepare(cfg: Any, console=print, replace: bool = False):
    """Prepare (or reuse) the seq2seq section's records in the run's data dir."""
    c = cfg.seq2seq
    if not c.data:
        raise DataError("objective seq2seq needs input -> target records: set seq2seq.data to .jsonl / "
                        ".parquet files (plain {input, target} records, or the chat records `lmforge tasks` "
                        "writes)")
    tok_file = tokenizer_file(cfg, cfg.objective.name)
    tok = Tokenizer.load(tok_file)
    eos = tok.eos_id
    enc_limit, dec_limit = cfg.seq_len, cfg.model.max_seq_len

    def side(text: str, limit: int) -> tuple[list[int] | None, bool]:
        """(its tokens then EOS within `limit`: whole, cut keeping the EOS, or None to drop; too long)"""
        ids = tok.encode(text)
        if len(ids) < limit:
            return ids + [eos], False
        return (None if c.overlong == "drop" else ids[: limit - 1] + [eos]), True

    def build() -> Built:
        records = split_records(lambda paths: read_pairs(paths, c), c, "seq2seq.data", cfg.run.seed)
        splits, counts = {}, {}
        for name, recs in records.items():
            xs, ys, over = [], [], 0
            for r in recs:
                (x, x_over), (y, y_over) = side(r.input, enc_limit), side(r.target, dec_limit)
                over += x_over or y_over
                if x is None or y is None:
                    continue
                xs.append(x)
                ys.append(y)
            x_len = np.asarray([len(x) for x in xs], dtype=np.int64)
            y_len = np.asarray([len(y) for y in ys], dtype=np.int64)
            splits[name] = {
                "ids": np.asarray([t for x in xs for t in x], dtype=np.int32),
                "offsets": np.concatenate([[0], np.cumsum(x_len)]).astype(np.int64),
                "target_ids": np.asarray([t for y in ys for t in y], dtype=np.int32),
                "target_offsets": np.concatenate([[0], np.cumsum(y_len)]).astype(np.int64)}
            counts[name] = {"examples": len(xs), "input tokens": int(x_len.sum()),
                            "target tokens": int(y_len.sum()),
                            ("dropped" if c.overlong == "drop" else "truncated"): int(over)}
        return Built(splits, counts)

    return prepare_dir(cfg, KIND, settings_of(c, cfg, tok_file, KIND), tok, build, console, replace)


class Seq2SeqLoader(TaskLoader):
    """Seq2SeqBatches of one split: encoder inputs right-padded with their attention mask, targets
    right-padded with IGNORE_INDEX (no loss there; the decoder reads them as its start token)."""

    kind = "Seq2SeqLoader"

    def collate(self, rows: np.ndarray) -> Seq2SeqBatch:
        ids = self.padded(rows, "ids", self.pad_id)
        lengths = np.asarray([int(self.split.lengths[int(i)]) for i in rows], dtype=np.int64)
        mask = (np.arange(ids.shape[1])[None] < lengths[:, None]).astype(np.int64)
        o, flat = self.split.target_offsets, self.split.target_ids
        targets = [flat[int(o[int(i)]): int(o[int(i) + 1])] for i in rows]
        out = np.full((len(rows), max(len(t) for t in targets)), IGNORE_INDEX, dtype=np.int64)
        for r, t in enumerate(targets):
            out[r, : len(t)] = t
        y = torch.from_numpy(out)
        return Seq2SeqBatch(torch.from_numpy(ids), y, torch.from_numpy(mask),
                            n_targets=int((y != IGNORE_INDEX).sum()))
