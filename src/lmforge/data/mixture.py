"""`MixtureLoader`: training windows drawn from several sources at configured weights, resumable exactly.

Each source is its own token stream (its train shards), cut into N_s windows of seq_len + 1 tokens like
`TokenLoader`'s. Global batch k (B x W rows over all ranks) draws the source of each of its rows from
the normalised weights, with a generator seeded by (seed, k) alone; a source's rows then take its next
windows in its own order: pass e of source s visits its windows in randperm(N_s) seeded by (seed, s, e),
and a source that runs out simply starts its next pass, reshuffled (its epoch count is logged). The
stream is therefore a pure function of (seed, weights, position): the state is the global batch count
plus the windows taken from each source, and resuming from it gives exactly the batches the run would
have had. Rank r takes rows r*B .. r*B+B-1 of every global batch.

As in HF datasets' interleave_datasets(probabilities=...) and Megatron's blended datasets, the weights
are sampling probabilities: 0.3 means about 30% of the windows (hence of the tokens) come from that
source, whatever its size. Its `epoch` (for train.epochs and train_epochs()) counts passes over as many
windows as all the sources hold together.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from lmforge.data.batch import TokenBatch
from lmforge.data.loader import TokenLoader
from lmforge.errors import DataError


def _seed(*parts: object) -> int:
    """A 63-bit generator seed from `parts`: distinct for every (role, seed, index) tuple."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class MixtureLoader:
    """`TokenBatch`es (B, T) drawn from `sources` (name -> shard files) at `weights`; Stateful."""

    def __init__(self, sources: dict[str, Sequence[str | Path | np.ndarray]], weights: dict[str, float],
                 seq_len: int, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1):
        if set(sources) != set(weights) or not sources:
            raise DataError(f"the prepared mixture holds sources {sorted(sources)} but data.sources names "
                            f"{sorted(weights)}; prepare the data again (or use another data.dir)")
        self.names = list(sources)
        # One window per row, read through TokenLoader's shard stream (batch 1: any non-empty source fits).
        self._streams = [self._stream(n, sources[n], seq_len) for n in self.names]
        self.windows = [s.num_windows for s in self._streams]
        total = sum(weights[n] for n in self.names)
        self.weights = [weights[n] / total for n in self.names]
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.global_batch = batch_size * world_size
        self.batches_per_epoch = max(sum(self.windows) // self.global_batch, 1)
        self.num_tokens = sum(s.num_tokens for s in self._streams)
        self.batches = 0  # global batches drawn so far
        self.taken = [0] * len(self.names)  # windows each source gave so far, over all ranks
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # source -> (pass, its window order)

    @staticmethod
    def _stream(name: str, shards: Sequence[str | Path | np.ndarray], seq_len: int) -> TokenLoader:
        try:
            return TokenLoader(shards, seq_len, 1, shuffle=False)
        except DataError as e:
            raise DataError(f"data.sources entry {name!r}: {e}") from None

    # ---- iteration ------------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (an epoch: as many windows as all the sources hold)."""
        return self.batches // self.batches_per_epoch

    @property
    def cursor(self) -> int:
        """Global batches drawn in the current epoch."""
        return self.batches % self.batches_per_epoch

    @property
    def tokens_seen(self) -> int:
        """Input tokens this rank has yielded so far."""
        return self.batches * self.batch_size * self.seq_len

    def draws(self, k: int) -> np.ndarray:
        """The source index of each row of global batch `k`."""
        g = torch.Generator().manual_seed(_seed("mix", self.seed, k))
        w = torch.tensor(self.weights, dtype=torch.float64)
        return torch.multinomial(w, self.global_batch, replacement=True, generator=g).numpy()

    def next_batch(self) -> TokenBatch:
        src = self.draws(self.batches)
        rows: list[tuple[int, int]] = []  # (source, window) of each global row
        for s in src:
            rows.append((int(s), self._window(int(s), self.taken[s])))
            self.taken[s] += 1
        self.batches += 1
        mine = rows[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        t = self.seq_len
        out = np.empty((len(mine), t + 1), dtype=np.int64)
        for j, (s, w) in enumerate(mine):
            self._streams[s]._read(w * t, out[j])
        x = torch.from_numpy(out)
        return TokenBatch(x[:, :-1].contiguous(), x[:, 1:].contiguous())

    def __iter__(self) -> Iterator[TokenBatch]:
        while True:
            yield self.next_batch()

    def metrics(self) -> dict[str, float]:
        """What each source gave so far, over all ranks: tokens_seen/<name> and epochs/<name> (passes)."""
        out: dict[str, float] = {}
        for name, n, total in zip(self.names, self.taken, self.windows):
            out[f"tokens_seen/{name}"] = n * self.seq_len
            out[f"epochs/{name}"] = round(n / total, 4)
        return out

    def _window(self, s: int, position: int) -> int:
        """Window number `position` of source `s`'s endless reshuffled stream."""
        n = self.windows[s]
        p, i = divmod(position, n)
        cached = self._orders.get(s)
        if cached is None or cached[0] != p:
            g = torch.Generator().manual_seed(_seed("source", self.seed, s, p))
            cached = (p, torch.randperm(n, generator=g).numpy())
            self._orders[s] = cached
        return int(cached[1][i])

    # ---- state --------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Position plus what it is only valid for; the same on every rank."""
        return {"mixture": 1, "batches": self.batches, "taken": list(self.taken), "names": list(self.names),
                "weights": [round(w, 12) for w in self.weights], "windows": list(self.windows),
                "seed": self.seed, "seq_len": self.seq_len, "global_batch": self.global_batch}

    def load_state_dict(self, sd: dict) -> None:
        """Resume at `sd`'s position; DataError if it was taken with other sources, weights or settings."""
        if "mixture" not in sd:
            raise DataError("the checkpoint's data loader read one stream, not a weighted mixture of "
                            "data.sources; resume with the data.sources it was trained with")
        mine = self.state_dict()
        keys = ("names", "weights", "windows", "seed", "seq_len", "global_batch")
        differ = [f"{k} {sd.get(k)} -> {mine[k]}" for k in keys if sd.get(k) != mine[k]]
        if differ:
            raise DataError(f"cannot resume the data mixture: {'; '.join(differ)} (checkpoint -> now); "
                            "resume with the same data.sources (weights included), seq_len, seed and global "
                            "batch (micro_batch_size x data-parallel ranks)")
        self.batches, self.taken = int(sd["batches"]), [int(n) for n in sd["taken"]]
        self._orders = {}


def train_loader(cfg, data, train_src, batch_size: int, rank: int, world_size: int):
    """The pretraining loader of `cfg`: a `MixtureLoader` when data.sources is weighted, else the one-stream
    `TokenLoader` over `train_src`."""
    mix = cfg.data.mixture
    if mix is None or data is None:
        return TokenLoader(train_src, cfg.seq_len, batch_size, seed=cfg.run.seed, rank=rank,
                           world_size=world_size)
    return MixtureLoader(data.source_shards(), dict(mix), cfg.seq_len, batch_size, seed=cfg.run.seed,
                         rank=rank, world_size=world_size)
