"""`lmforge estimate`: the estimate as a rich table (or JSON), the verdict and what would fit."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from lmforge.config.schema import Config
from lmforge.errors import ConfigError
from lmforge.tools.estimate import GiB, MiB, device_memory, estimate, suggest


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


MAX_TOKENIZER_BYTES = 1 << 29  # the largest tokenizer.json files published are tens of MiB


def _read_small_file(path: Path) -> str:
    """The text of `path`, refused unless it is a regular file of at most MAX_TOKENIZER_BYTES: opening
    a FIFO does not block (O_NONBLOCK) and a device or a huge file is never read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("it is not a regular file")
        if st.st_size > MAX_TOKENIZER_BYTES:
            raise ValueError(f"it holds {st.st_size:,} bytes, more than a tokenizer.json's "
                             f"{MAX_TOKENIZER_BYTES:,}")
        return f.read(MAX_TOKENIZER_BYTES + 1).decode("utf-8")


def with_vocab_size(cfg: Config) -> tuple[Config, str | None]:
    """`cfg` with model.vocab_size filled the way a run fills it (the tokenizer's size rounded up to a
    multiple of 64), from the prepared data's tokenizer, else data.tokenizer.path, else the size a
    trained BPE will have (data.tokenizer.vocab_size); and a note saying which, None when it was set."""
    if cfg.model.vocab_size is not None:
        return cfg, None
    from tokenizers import Tokenizer

    from lmforge.assembly.build import resolve_vocab_size
    from lmforge.data.prepare import TOKENIZER_FILE, data_dir

    prepared = data_dir(cfg) / TOKENIZER_FILE
    path = prepared if prepared.is_file() else cfg.data.tokenizer.path
    if path is not None:
        try:
            text = _read_small_file(Path(path))
            n, where = Tokenizer.from_str(text).get_vocab_size(), f"the tokenizer {path}"
        except Exception as e:  # a broken file is the user's to fix; say which
            raise ConfigError(f"cannot read the tokenizer {path} to size the vocabulary ({e}); set "
                              "model.vocab_size") from None
    else:
        n, where = cfg.data.tokenizer.vocab_size, "data.tokenizer.vocab_size (the BPE a run trains)"
    vocab = resolve_vocab_size(cfg, n)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": vocab})})
    return cfg, f"model.vocab_size={vocab}, from {where}, rounded up to a multiple of 64"


def run_estimate(cfg: Config, world_size: int, device: str | None, device_memory_gib: float | None,
                 as_json: bool) -> int:
    """Print the estimate of `cfg` on `world_size` ranks, the verdict against the device's memory and,
    when it does not fit, settings that do (each found by re-running the estimate). Exit status 0
    when it fits, 1 when it does not."""
    from lmforge.checkpoint.runs import resolve_init_from

    kind, budget, source = device_memory(device, device_memory_gib)
    # fine-tuning takes its architecture (and tokenizer) from model.init_from, as a run resolves it
    init_notes: list[str] = []
    cfg = resolve_init_from(cfg, say=init_notes.append)
    if cfg.model.init_from:
        init_notes.insert(0, f"model.init_from: the architecture of {cfg.model.init_from}")
    cfg, vocab_note = with_vocab_size(cfg)
    est = estimate(cfg, world_size, kind)
    fits = est.peak <= budget and (kind != "cpu" or est.peak + est.host_total <= budget)
    tips = [] if fits else suggest(cfg, world_size, kind, budget)
    if as_json:
        out = est.to_json()
        out.update({"budget_bytes": budget, "budget_source": source, "fits": fits, "vocab_note": vocab_note,
                    "init_notes": init_notes,
                    "suggestions": [{"set": s.change, "peak_bytes": s.peak, "why": s.why} for s in tips]})
        print(json.dumps(out, indent=2))
        return 0 if fits else 1
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    tc = cfg.train
    title = (f"lmforge estimate: {est.method}; {est.layout.name}, {est.rank} of {world_size}; "
             f"{est.params:,} parameters; "
             f"micro-batch {tc.micro_batch_size} x {cfg.seq_len} tokens, accumulation {tc.grad_accum_steps}, "
             f"{est.precision}, activation checkpointing {tc.activation_checkpointing}")
    table = Table(title=title, show_header=True)
    table.add_column("component (per rank)")
    table.add_column(f"{kind} memory", justify="right")
    for name, n in est.rows.items():
        table.add_row(name, _size(n))
    for name, n in est.host.items():
        table.add_row(f"{name} [host RAM, offloaded]", _size(n))
    table.add_row(f"peak ({est.peak_moment})", _size(est.peak), style="bold")
    console.print(table)
    for note in init_notes + ([vocab_note] if vocab_note else []) + list(est.notes):
        console.print(f"note: {note}", markup=False)
    verdict = "fits" if fits else "does NOT fit"
    console.print(f"verdict: peak {_size(est.peak)} per rank {verdict} in {_size(budget)} ({source})",
                  markup=False)
    if not fits:
        if tips:
            for s in tips:
                sets = " ".join(f"--set {k}={v}" for k, v in s.change.items())
                console.print(f"  try {sets}: peak {_size(s.peak)} ({s.why})", markup=False)
        else:
            console.print("  no single change tried (smaller micro-batch with more accumulation, activation "
                          "checkpointing, chunked loss, ZeRO stage, CPU offload) fits; use more ranks or a "
                          "smaller model", markup=False)
    return 0 if fits else 1
