"""The argparse types of every numeric flag: `type=number(whole(1, 1024))` parses the text, refuses what is
not finite or not in the range (argparse then prints `lmforge VERB: error: argument --flag: must be a whole
number from 1 to 1,024, got '0'` and the verb exits 2 before any work), and hands the verb a checked value.

The ranges below are the CLI's; each says why its ends sit where they do. Functions that Python callers
reach directly check their own arguments too (the same Bound where they share one)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from lmforge.utils.bounds import PORT, SEED, THREADS, Bound, real, whole

__all__ = ["PORT", "SEED", "THREADS", "number", "real", "whole"]


def number(bound: Bound) -> Callable[[str], int | float]:
    """An argparse `type` for flags whose value must lie in `bound` (whole numbers or finite reals)."""

    def parse(text: str) -> int | float:
        try:
            value: int | float = int(text) if bound.integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {bound.describe()}, got {text[:40]!r}") from None
        if bound.problem(value) is not None:
            raise argparse.ArgumentTypeError(f"must be {bound.describe()}, got {text[:40]!r}")
        return value

    parse.__name__ = "whole number" if bound.integer else "number"
    return parse


COUNT = whole(1, 10**9)  # "the first N" limits: no work beyond what the inputs hold, so only a sanity cap
RECORDS = whole(1, 1_000_000)  # records `tasks` holds in memory (a few hundred bytes each) before writing
BATCH = whole(1, 4096)  # sequences decoded or scored together (memory grows with it)
SERVE_BATCH = whole(1, 1024)  # serve's KV-cache rows (lmforge.serve.MAX_BATCH: the same range)
PREFIX_MB = whole(0, 1_048_576)  # serve's prefix-cache MiB (lmforge.serve.PREFIX_MB: the same range)
WORLD = whole(1, 1_000_000)  # ranks a schedule or estimate is planned for
TOKENS = whole(1, 1_048_576)  # tokens generated / per window: above any model's context today
FEWSHOT = whole(0, 1000)  # harness tasks use at most a few dozen
TEMPERATURE = real(0.0, 100.0)  # 0: greedy; far above 2 the samples are noise already
LR = real(0.0, 1e6, lo_open=True)  # lr-find sweeps past divergence (1e3 is common)
FRACTION = real(0.0, 1.0, hi_open=True)  # e.g. prune's sparsity: all of it would leave nothing
OPEN_FRACTION = real(0.0, 1.0, lo_open=True, hi_open=True)
SHARD_GB = real(0.001, 1024.0)  # safetensors shards from 1 MB to 1 TB
POSITIVE = real(0.0, None, lo_open=True)
