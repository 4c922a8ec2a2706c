"""Batch-size warm-up: tokens per optimizer step grow linearly over the first N tokens (GPT-3 went
from 32K to 3.2M tokens per step), by varying how many micro-batches each step accumulates.

A pure function of the tokens seen so far, so the ramp needs no state of its own: a resumed
run (whose checkpoint holds `tokens_seen`) continues the ramp exactly where it stopped.
"""

from __future__ import annotations

import math

from lmforge.config.schema import Config


class BatchRamp:
    def __init__(self, cfg: Config, dp_size: int) -> None:
        tc = cfg.train
        self.full = tc.grad_accum_steps
        self.micro_tokens = tc.micro_batch_size * cfg.seq_len * dp_size  # one micro-batch on every rank
        self.ramp_tokens = tc.batch_warmup_tokens
        start = tc.batch_warmup_start_tokens or self.micro_tokens
        self.start = min(self.full, max(1, round(start / self.micro_tokens)))

    def micro_batches(self, tokens_seen: int) -> int:
        """Micro-batches per rank for the step taken after `tokens_seen` tokens."""
        if tokens_seen >= self.ramp_tokens:
            return self.full
        frac = tokens_seen / self.ramp_tokens
        # Round up so the ramp reaches full size by ramp_tokens, not after it.
        return min(self.full, max(self.start, math.ceil(self.start + frac * (self.full - self.start))))

    def tokens_per_step(self, tokens_seen: int) -> int:
        return self.micro_batches(tokens_seen) * self.micro_tokens

    def total_tokens(self, steps: int) -> int:
        """Tokens a run of `steps` optimizer steps sees (the horizon of a token schedule)."""
        tokens = 0
        for done in range(steps):
            if tokens >= self.ramp_tokens:  # the rest of the run is at full size
                return tokens + (steps - done) * self.full * self.micro_tokens
            tokens += self.tokens_per_step(tokens)
        return tokens
