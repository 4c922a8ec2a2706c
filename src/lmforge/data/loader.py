"""`TokenLoader`: fixed-length training windows from memory-mapped token shards, resumable exactly.

A split's shards form one token stream (documents packed back to back, EOS between them, as in
nanoGPT / GPT-2). The stream is cut into N = (tokens - 1) // T non-overlapping windows; window w gives
inputs tokens[wT : wT+T] and targets tokens[wT+1 : wT+T+1]. Epoch e visits the windows in the order
randperm(N) seeded with seed * 1000003 + e, and rank r of W takes every W-th window of that order
(after trimming it to a multiple of W), so ranks are disjoint, cover the data and all take the same
number of batches. The global batch k is therefore order[k*B*W : (k+1)*B*W]: this is what lets a run
resume with another world size when that position divides evenly.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from lmforge.data.batch import TokenBatch
from lmforge.data.shards import open_shard
from lmforge.errors import DataError

_SEED_STRIDE = 1000003  # a prime: epochs of nearby seeds never share a permutation seed
_CHECKED = ("seq_len", "seed", "num_windows", "shuffle", "drop_last")


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
        self._per_rank = self.num_windows // world_size
        need = world_size * (batch_size if drop_last else 1)
        if self.num_tokens < seq_len + 1 or self.num_windows < need:
            raise DataError(
                f"the split has {self.num_tokens:,} tokens in {len(shard_paths)} shard(s) "
                f"({self.num_windows:,} windows); seq_len={seq_len}, batch_size={batch_size} on "
                f"world_size={world_size} need at least {need * seq_len + 1:,} tokens: use more data, "
                "a shorter seq_len or a smaller batch"
            )
        full, rest = divmod(self._per_rank, batch_size)
        self.batches_per_epoch = full + (1 if rest and not drop_last else 0)
        self._windows_per_epoch = self._per_rank if not drop_last else full * batch_size
        self._epoch = 0
        self._cursor = 0  # batches taken in the current epoch; always < batches_per_epoch
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, this rank's windows) cache

    # ---- iteration ------------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def tokens_seen(self) -> int:
        """Input tokens this rank has yielded so far (multiply by world_size for the global count)."""
        windows = self._epoch * self._windows_per_epoch + self._cursor * self.batch_size
        return windows * self.seq_len

    def next_batch(self) -> TokenBatch:
        """The next batch; moves to the next epoch after the last one."""
        b = self.batch_size
        windows = self._rank_windows(self._epoch)[self._cursor * b:(self._cursor + 1) * b]
        self._cursor += 1
        if self._cursor == self.batches_per_epoch:
            self._epoch, self._cursor = self._epoch + 1, 0
        return self._gather(windows)

    def __iter__(self) -> Iterator[TokenBatch]:
        while True:
            yield self.next_batch()

    def iter_eval_batches(
        self, max_batches: int | None = None
    ) -> Iterator[TokenBatch]:
        """One sequential pass over this rank's windows (no shuffle); the loader's state is untouched."""
        windows = self._rank_slice(np.arange(self.num_windows))
        stop = len(windows) if not self.drop_last else len(windows) // self.batch_size * self.batch_size
        for k, i in enumerate(range(0, stop, self.batch_size)):
            if max_batches is not None and k >= max_batches:
                return
            yield self._gather(windows[i:i + self.batch_size])

    # ---- state --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """Position plus the settings it is only valid for; the same on every rank."""
        return {"epoch": self._epoch, "cursor": self._cursor, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "seed": self.seed, "world_size": self.world_size,
                "num_windows": self.num_windows, "shuffle": int(self.shuffle),
                "drop_last": int(self.drop_last)}

    def load_state_dict(self, sd: dict) -> None:
        """Resume at the position in `sd`; DataError if it was taken with other data or settings.

        A different world size or per-rank batch size (e.g. 2 ranks x 4 -> 1 rank x 8, the same global
        batch) is accepted when the global position (cursor * batch_size * world_size windows into
        the epoch) is a whole number of new global batches; otherwise resume on the old layout.
        """
        missing = [k for k in ("epoch", "cursor", "world_size", "batch_size", *_CHECKED) if k not in sd]
        if missing:
            raise DataError(f"data loader state lacks {', '.join(missing)}; it is not a TokenLoader state")
        mine = self.state_dict()
        differ = [f"{k} {int(sd[k])} -> {mine[k]}" for k in _CHECKED if int(sd[k]) != mine[k]]
        if differ:
            raise DataError(f"cannot resume the data loader: {'; '.join(differ)} (checkpoint -> now); "
                            "resume with the same data, seq_len and seed")
        epoch, cursor = int(sd["epoch"]), int(sd["cursor"])
        old_ws, old_bs = int(sd["world_size"]), int(sd["batch_size"])
        global_windows = cursor * old_bs * old_ws
        cursor, rem = divmod(global_windows, self.batch_size * self.world_size)
        if rem or cursor > self.batches_per_epoch or epoch < 0:
            raise DataError(
                f"cannot resume the data loader saved on world_size={old_ws} x batch_size={old_bs} at epoch "
                f"{epoch}, batch {int(sd['cursor'])} on world_size={self.world_size} x batch_size="
                f"{self.batch_size}: that position is not a whole number of global batches here; resume "
                "on the old layout"
            )
        if cursor == self.batches_per_epoch:
            epoch, cursor = epoch + 1, 0
        self._epoch, self._cursor = epoch, cursor

    # ---- internals ----------------------------------------------------------------------------------

    def _rank_slice(self, order: np.ndarray) -> np.ndarray:
        return order[: self._per_rank * self.world_size][self.rank::self.world_size]

    def _rank_windows(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + epoch)
                order = torch.randperm(self.num_windows, generator=g).numpy()
            else:
                order = np.arange(self.num_windows)
            self._order = (epoch, self._rank_slice(order))
        return self._order[1]

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
