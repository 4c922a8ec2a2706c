"""`TokenLoader`: fixed-length training windows from memory-mapped token shards, resumable exactly.

A split's shards form one token stream (documents packed back to back, EOS between them, as in
nanoGPT / GPT-2). The stream is cut into N = (tokens - 1) // T non-overlapping windows; window w gives
inputs tokens[wT : wT+T] and targets tokens[wT+1 : wT+T+1]. Epoch e visits the windows in the order
randperm(N) seeded with seed * 1000003 + e, and rank r of W takes every W-th window of that order
(after trimming it to a multiple of W), so ranks are disjoint, cover the data and all take the same
number of batches (the `EpochSampler` every loader shares). The global batch k is therefore
order[k*B*W : (k+1)*B*W]: this is what lets a run resume with another world size when that position
divides evenly.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from lmforge.data.batch import TokenBatch
from lmforge.data.sampler import EpochSampler
from lmforge.data.shards import open_shard
from lmforge.errors import DataError


class TokenLoader:
    """`TokenBatch`es of int64 (inputs, targets), each (B, T); Stateful (state_dict / load_state_dict).

    A shard is a token file written by `prepare` (memory-mapped) or a 1-D integer array already in
    memory (what the Python API's own datasets become).

    With drop_last=False the last batch of an epoch may have fewer than B rows; batches never straddle
    two epochs. Uses its own torch.Generator, never the global RNG.
    """

    def __init__(
        self,
        shard_paths: Sequence[str | Path | np.ndarray],
        seq_len: int,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if seq_len < 1 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad loader settings: seq_len={seq_len}, batch_size={batch_size}, "
                             f"rank={rank}, world_size={world_size}")
        if not shard_paths:
            raise DataError("no shard files given to the data loader; prepare the data first")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size, self.shuffle, self.drop_last = rank, world_size, shuffle, drop_last
        opened = (p if isinstance(p, np.ndarray) else open_shard(p) for p in shard_paths)
        self._shards = [s for s in opened if len(s)]
        self._starts = [0]  # offset of each shard in the stream
        for s in self._shards:
            self._starts.append(self._starts[-1] + len(s))
        self.num_tokens = self._starts[-1]
        self.num_windows = max(self.num_tokens - 1, 0) // seq_len
        need = world_size * (batch_size if drop_last else 1)
        if self.num_tokens < seq_len + 1 or self.num_windows < need:
            raise DataError(
                f"the split has {self.num_tokens:,} tokens in {len(shard_paths)} shard(s) "
                f"({self.num_windows:,} windows); seq_len={seq_len}, batch_size={batch_size} on "
                f"world_size={world_size} need at least {need * seq_len + 1:,} tokens: use more data, "
                "a shorter seq_len or a smaller batch"
            )
        self.sampler = EpochSampler(self.num_windows, batch_size, seed=seed, rank=rank, world_size=world_size,
                                    shuffle=shuffle, drop_last=drop_last, kind="TokenLoader",
                                    count_key="num_windows", settings={"seq_len": seq_len})
        self.batches_per_epoch = self.sampler.batches_per_epoch

    # ---- iteration ------------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self.sampler.epoch

    @property
    def cursor(self) -> int:
        """Batches taken in the current epoch."""
        return self.sampler.cursor

    @property
    def tokens_seen(self) -> int:
        """Input tokens this rank has yielded so far (multiply by world_size for the global count)."""
        return self.sampler.units_taken * self.seq_len

    def next_batch(self) -> TokenBatch:
        """The next batch; moves to the next epoch after the last one."""
        return self._gather(self.sampler.next_units())

    def __iter__(self) -> Iterator[TokenBatch]:
        while True:
            yield self.next_batch()

    def iter_eval_batches(
        self, max_batches: int | None = None
    ) -> Iterator[TokenBatch]:
        """One sequential pass over this rank's windows (no shuffle); the loader's state is untouched."""
        for windows in self.sampler.eval_units(max_batches):
            yield self._gather(windows)

    # ---- state --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """Position plus the settings it is only valid for; the same on every rank."""
        return self.sampler.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        """Resume at the position in `sd`; DataError if it was taken with other data or settings, or
        on a layout it does not divide into (see EpochSampler.load_state_dict)."""
        self.sampler.load_state_dict(sd)

    # ---- internals ----------------------------------------------------------------------------------

    def _gather(self, windows: np.ndarray) -> TokenBatch:
        t = self.seq_len
        rows = np.empty((len(windows), t + 1), dtype=np.int64)
        for j, w in enumerate(windows):
            self._read(int(w) * t, rows[j])
        x = torch.from_numpy(rows)
        return TokenBatch(x[:, :-1].contiguous(), x[:, 1:].contiguous())  # (B, T) each, shifted by one

    def _read(self, start: int, out: np.ndarray) -> None:
        """Copy tokens [start, start + len(out)) of the stream into `out`, across shard boundaries."""
        i = bisect.bisect_right(self._starts, start) - 1
        pos = 0
        while pos < len(out):
            shard = self._shards[i]
            off = start + pos - self._starts[i]
            take = min(len(out) - pos, len(shard) - off)
            out[pos:pos + take] = shard[off:off + take]
            pos += take
            i += 1
