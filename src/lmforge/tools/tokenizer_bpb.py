"""`lmforge tokenizer compare --train-budget`: a short training of the same model per tokenizer, then its
bits per byte of the held-out text.

Each tokenizer's run is the config's (model, optimizer, data.sources, seed) with data.tokenizer.path set to
the tokenizer, train.max_time to the budget and train.max_steps out of reach, so the clock ends every run
alike; a schedule left in its default steps unit counts time instead (warm-up 5% of the budget). The run
then scores the held-out documents in disjoint windows of model.max_seq_len tokens (each document followed
by the end-of-document token, as in training), and bits per byte is the summed loss in bits over the
UTF-8 bytes of the held-out *text*: one denominator for every tokenizer, whatever its token_byte_lengths
say (a WordPiece's drop whitespace), so the numbers compare across kinds.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from pathlib import Path

from lmforge.config.load import load_config
from lmforge.errors import LmforgeError

EVAL_BATCH = 8  # windows per forward when scoring the held-out text
WARMUP_SHARE = 0.05  # of the budget, when the config's schedule is the default one


def _overrides(config: str | None, sets: list[str], run_dir: Path, tokenizer: Path,
               budget: float) -> list[str]:
    """The --set list of one tokenizer's run: the user's, then what makes the runs a fair comparison."""
    ours = [f"run.dir={run_dir}", f"data.dir={run_dir / 'data'}", "data.tokenizer.kind=bpe",
            f"data.tokenizer.path={tokenizer}", f"train.max_time={budget}", "train.max_steps=1000000"]
    s = load_config(config, sets).schedule
    if s.unit == "steps" and s.warmup_steps is None and s.decay_steps is None:
        ours += ["schedule.unit=time", f"schedule.warmup_seconds={WARMUP_SHARE * budget:g}"]
    return [*sets, *ours]


def budget_bpb(config: str | None, sets: list[str], tokenizers: dict[str, Path], held_out: list[str],
               budget: float, work_dir: Path, say: Callable[[str], object] = print) -> dict[str, dict]:
    """{label: {bpb, tokens, steps, train_loss}} for each tokenizer file of `tokenizers`, trained for
    `budget` seconds into work_dir/<label> (training's own lines go to stderr, keeping stdout for the
    report)."""
    from lmforge.eval.open_run import load_run
    from lmforge.eval.perplexity import strided_eval, token_stream
    from lmforge.train.trainer import train

    n_bytes = sum(len(d.encode("utf-8")) for d in held_out)
    out = {}
    for label, file in tokenizers.items():
        run_dir = work_dir / label
        cfg = load_config(config, _overrides(config, sets, run_dir, file, budget))
        say(f"training {label} for {budget:g}s into {run_dir}")
        with contextlib.redirect_stdout(sys.stderr):
            final = train(cfg)
            run = load_run(run_dir)
        length = run.model.cfg.max_seq_len
        ids = token_stream(run.tokenizer, held_out)
        if len(ids) < 2:
            raise LmforgeError("the held-out text encodes to no tokens to predict; give more held-out text")
        got = strided_eval(run.model, ids, max_length=length, stride=length, batch_size=EVAL_BATCH,
                           device=run.device, autocast=run.precision.autocast)
        out[label] = {"bpb": got["nll_sum"] / math.log(2) / n_bytes, "loss": got["loss"],
                      "eval_tokens": got["tokens"], "eval_bytes": n_bytes, "steps": (final or {}).get("step"),
                      "train_loss": (final or {}).get("train_loss")}
    return out
