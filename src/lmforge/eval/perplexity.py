"""Held-out perplexity, bits per byte, token accuracy and next-token calibration of a causal LM on any
text, scored with sliding windows as in the Hugging Face guide "Perplexity of fixed-length models".

The documents become one stream (`token_stream`): an end-of-text token, then each document's tokens
followed by end-of-text, so the first token of every document is predicted too. Windows of at most
`max_length` tokens start every `stride` tokens; a window's targets are only the tokens the previous
window did not score (its last `end - prev_end`), the tokens before them are context. With
stride == max_length the windows are disjoint and a window's first token, having no context, is not
scored; with stride < max_length every token after the first is scored exactly once.

The loss is exact per token: the sum of every target's negative log-likelihood divided by the number
of targets. (The guide multiplies each window's mean loss by `valid labels - 1`, which is the number
of losses the model averaged only for a window without context; for a later window with
stride < max_length the model averaged one more, so its sum is slightly off. The parity test
`tests/parity/test_strided_perplexity.py` shows both.)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.chat import BadRow, ChatStats, iter_records
from lmforge.data.sources import (
    JSONL_EXTENSIONS,
    PARQUET_EXTENSIONS,
    TEXT_EXTENSIONS,
    _open_regular,
    check_source,
    walk_files,
)
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import DataError
from lmforge.eval.metrics import expected_calibration_error

TEXT_KEY = "text"
TOP_K = 5
CALIBRATION_BINS = 10


# ---------------------------------------------------------------------------------------------- reading


def read_texts(path: str | Path) -> list[tuple[str, str]]:
    """(where, text) of every document under `path`: a .txt/.md file (one document), a JSONL file (one
    per line, its "text" field), a Parquet file (one per row, its "text" column) or a folder of those
    (sorted walk; other extensions and hidden entries are left out). A file named explicitly is read
    as plain text unless it is .jsonl or .parquet. `where` is the file, `file:line` or `file:row N`.

    Empty and whitespace-only documents are left out. DataError for a missing path, an unreadable
    file, bad UTF-8, a JSONL line or Parquet row without a string "text" (naming file:line or row),
    or when no document is found.
    """
    check_source(str(path))  # missing, FIFO, device...: a DataError naming the path
    root = Path(path)
    if root.is_dir():
        files = [f for f in walk_files(root) if f.suffix.lower() in _READ_EXTENSIONS]
        if not files:
            raise DataError(f"{root}: no {', '.join(_READ_EXTENSIONS)} files in this folder; give a file "
                            "or a folder holding text to evaluate on")
    else:
        files = [root]
    out = [(where, text) for f in files for where, text in _read_file(f) if text and not text.isspace()]
    if not out:
        raise DataError(f"{root}: no text to evaluate on (every document is empty)")
    return out


_READ_EXTENSIONS = TEXT_EXTENSIONS + JSONL_EXTENSIONS + PARQUET_EXTENSIONS


def _read_file(path: Path) -> Iterator[tuple[str, str]]:
    if path.suffix.lower() not in JSONL_EXTENSIONS + PARQUET_EXTENSIONS:
        yield str(path), _read_plain(path)
        return
    for _, records in iter_records(path, ChatStats()):
        for where, record in records:
            yield where, _record_text(where, record)


def _read_plain(path: Path) -> str:
    try:
        with _open_regular(path) as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}; give a readable file") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 at byte offset {e.start} ({e.reason}); evaluation "
                        "text must be UTF-8") from None


def _record_text(where: str, record: Any) -> str:
    if isinstance(record, BadRow):
        raise DataError(f"{where}: {record.why}; fix the line")
    if not isinstance(record, dict) or TEXT_KEY not in record:
        fields = f" (fields: {', '.join(map(str, record))})" if isinstance(record, dict) else ""
        raise DataError(f"{where}: record has no {TEXT_KEY!r} field{fields}; each record needs its text "
                        f"under {TEXT_KEY!r}")
    text = record[TEXT_KEY]
    if not isinstance(text, str):
        raise DataError(f"{where}: {TEXT_KEY!r} is a {type(text).__name__}, not a string")
    return text


def token_stream(tokenizer: Tokenizer, texts: Iterable[str]) -> list[int]:
    """[eos] + doc_1 + [eos] + doc_2 + [eos] ...: each text encoded without special tokens (as
    `tokenizer.encode`) and closed by end-of-text; the leading end-of-text lets the first token be
    predicted. The targets are every token after position 0."""
    ids = [tokenizer.eos_id]
    for doc in tokenizer.encode_batch(list(texts)):
        ids.extend(doc)
        ids.append(tokenizer.eos_id)
    return ids


# ---------------------------------------------------------------------------------------------- windows


@dataclass(frozen=True)
class Window:
    """ids[begin:end] go in; the last `targets` of them are scored (the rest is context)."""

    begin: int
    end: int
    targets: int


def sliding_windows(n: int, max_length: int, stride: int) -> list[Window]:
    """The guide's windows over a stream of `n` tokens: begin = 0, stride, 2 * stride, ...;
    end = min(begin + max_length, n); the targets are the tokens after the previous window's end,
    less the window's first token when it is one of them (nothing precedes it in the window). Stops
    at the first window that reaches the end of the stream."""
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2 (one token of context and one target), got "
                         f"{max_length}")
    if not 1 <= stride <= max_length:
        raise ValueError(f"stride must be between 1 and max_length={max_length}, got {stride}: a larger "
                         "stride would leave tokens unscored")
    out = []
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + max_length, n)
        out.append(Window(begin, end, min(end - prev_end, end - begin - 1)))
        prev_end = end
        if end == n:
            break
    return out


# ---------------------------------------------------------------------------------------------- scoring


@torch.no_grad()
def strided_eval(
    model: nn.Module,
    ids: list[int],
    *,
    max_length: int,
    stride: int,
    batch_size: int = 8,
    device: torch.device | str | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    token_bytes: torch.Tensor | np.ndarray | None = None,
) -> dict[str, Any]:
    """Score the stream `ids` with `model` (`model(input_ids (B, T)) -> logits (B, T, V)`) in sliding
    windows (`sliding_windows`), `batch_size` windows per forward (right-padded: the model is causal).

    Returns loss (mean NLL per target, nats), ppl, nll_sum, tokens (targets), windows, top1 / top5
    (accuracy of the target being the most likely / among the 5 most likely), ece / ece_adaptive
    (10 equal-width / equal-mass bins of the max softmax probability against top-1 hits), with
    `token_bytes` (UTF-8 bytes per token id, `Tokenizer.token_byte_lengths()`) bytes and bpb (summed
    loss in bits / bytes of the targets), and the per-target arrays `confidence` (float64, max softmax
    probability) and `correct` (bool, top-1 hit) for `metrics.reliability_diagram`.
    The model runs in eval mode (its mode is restored after); log-softmax is in float32 or wider.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    limit = getattr(getattr(model, "cfg", None), "max_seq_len", None)
    if limit is not None and max_length > limit:
        raise ValueError(f"max_length={max_length} exceeds the model's context (max_seq_len={limit}); "
                         "give a max_length up to it")
    # A window of one token after a disjoint window scores nothing (the guide's loss is NaN there).
    windows = [w for w in sliding_windows(len(ids), max_length, stride) if w.targets > 0]
    if not windows:
        raise DataError(f"the token stream has {len(ids)} token(s): nothing to predict")
    if device is None:
        device = next(model.parameters()).device
    stream = torch.as_tensor(ids, dtype=torch.long)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("nll", "conf", "top1", "top5", "target")}
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(windows), batch_size):
            chunk = windows[start : start + batch_size]
            x = torch.zeros(len(chunk), max(w.end - w.begin for w in chunk), dtype=torch.long)
            for j, w in enumerate(chunk):
                x[j, : w.end - w.begin] = stream[w.begin : w.end]
            with (autocast or contextlib.nullcontext)():
                logits = model(x.to(device))  # (B, T, V)
            for j, w in enumerate(chunk):
                _score(logits[j], stream, w, parts)
    finally:
        model.train(was_training)
    got = {k: torch.cat(v) for k, v in parts.items()}
    return _summary(got, len(windows), token_bytes)


def _score(logits: torch.Tensor, stream: torch.Tensor, w: Window,
           parts: dict[str, list[torch.Tensor]]) -> None:
    """Append the per-target numbers of window `w` (its logits (T, V)) to `parts`, on the CPU."""
    n = w.end - w.begin
    rows = logits[n - w.targets - 1 : n - 1]  # (targets, V): position i predicts token i + 1
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    target = stream[w.end - w.targets : w.end].to(rows.device)
    logp = F.log_softmax(rows, dim=-1)
    top = rows.topk(min(TOP_K, rows.shape[-1]), dim=-1).indices  # (targets, k)
    parts["nll"].append(-logp.gather(1, target[:, None]).squeeze(1).double().cpu())
    parts["conf"].append(logp.max(dim=-1).values.double().exp().cpu())
    parts["top1"].append((rows.argmax(dim=-1) == target).cpu())
    parts["top5"].append((top == target[:, None]).any(dim=-1).cpu())
    parts["target"].append(target.cpu())


def _summary(got: dict[str, torch.Tensor], n_windows: int,
             token_bytes: torch.Tensor | np.ndarray | None) -> dict[str, Any]:
    n = int(got["nll"].numel())
    nll_sum = float(got["nll"].sum())
    loss = nll_sum / n
    confidence = got["conf"].numpy()
    correct = got["top1"].numpy()
    out: dict[str, Any] = {
        "loss": loss,
        "ppl": math.exp(min(loss, 700.0)),
        "nll_sum": nll_sum,
        "tokens": n,
        "windows": n_windows,
        "top1": float(correct.mean()),
        "top5": float(got["top5"].double().mean()),
    }
    if token_bytes is not None:
        n_bytes = int(torch.as_tensor(token_bytes)[got["target"]].sum())
        if n_bytes > 0:
            out["bytes"] = n_bytes
            out["bpb"] = nll_sum / math.log(2) / n_bytes
    out["ece"] = expected_calibration_error(confidence, correct, CALIBRATION_BINS)
    out["ece_adaptive"] = expected_calibration_error(confidence, correct, CALIBRATION_BINS, adaptive=True)
    out["confidence"] = confidence
    out["correct"] = correct
    return out


def evaluate_perplexity(
    model: nn.Module,
    tokenizer: Tokenizer,
    path: str | Path,
    *,
    max_length: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    device: torch.device | str | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    limit: float | None = None,
) -> dict[str, Any]:
    """`strided_eval` of the documents under `path` (`read_texts`, `token_stream`; with `limit`, the first
    N of them or that fraction, as --limit), with bits per byte; max_length defaults to the model's
    max_seq_len and stride to half of max_length (the guide's ratio). Adds documents, max_length and
    stride to the result."""
    from lmforge.eval.tasks import select

    if max_length is None:
        max_length = model.cfg.max_seq_len
    if stride is None:
        stride = max(1, max_length // 2)
    texts = read_texts(path)
    texts = texts[: select(len(texts), limit)]
    ids = token_stream(tokenizer, [t for _, t in texts])
    out = strided_eval(model, ids, max_length=max_length, stride=stride, batch_size=batch_size,
                       device=device, autocast=autocast, token_bytes=tokenizer.token_byte_lengths())
    return {"documents": len(texts), "max_length": max_length, "stride": stride, **out}
