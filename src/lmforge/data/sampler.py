"""`EpochSampler`: which units (token windows, packed rows, conversations, pairs, prompts) each batch of
this rank takes, and the exact-resume check; shared by every loader so the rule lives once.

Epoch e visits the N units in the order randperm(N) seeded with seed * 1000003 + e (or 0..N-1 without
shuffle); rank r of W takes every W-th unit of that order, after trimming it to a multiple of W, so ranks
are disjoint, cover the data and all take the same number of batches. The global batch k is therefore
order[k*B*W : (k+1)*B*W]: this is what lets a run resume with another world size or per-rank batch when
that position divides evenly.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from lmforge.errors import DataError

SEED_STRIDE = 1000003  # a prime: epochs of nearby seeds never share a permutation seed
_POSITION = ("epoch", "cursor", "world_size", "batch_size")
_OWN_CHECKED = ("seed", "shuffle", "drop_last")


class EpochSampler:
    """The position (epoch, batches taken in it) over `num_units` units; Stateful.

    `settings` are the loader's own facts a saved position is only valid for (seq_len, packing): they
    are saved with the position, as is num_units under `count_key`, and must match on resume. `kind`
    names the loader in messages. With drop_last=False an epoch's last batch may hold fewer than batch_size
    units; batches never straddle two epochs. Uses its own torch.Generator, never the global RNG.
    """

    def __init__(self, num_units: int, batch_size: int, *, seed: int, rank: int, world_size: int,
                 shuffle: bool, drop_last: bool, kind: str, count_key: str,
                 settings: dict[str, int]) -> None:
        self.num_units, self.batch_size, self.seed = num_units, batch_size, seed
        self.rank, self.world_size, self.shuffle, self.drop_last = rank, world_size, shuffle, drop_last
        self.kind, self.count_key, self.settings = kind, count_key, dict(settings)
        self.per_rank = num_units // world_size
        full, rest = divmod(self.per_rank, batch_size)
        self.batches_per_epoch = full + (1 if rest and not drop_last else 0)
        self.units_per_epoch = self.per_rank if not drop_last else full * batch_size  # this rank's
        self.epoch = 0
        self.cursor = 0  # batches taken in the current epoch; always < batches_per_epoch
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, this rank's units) cache

    @property
    def units_taken(self) -> int:
        """Units this rank has taken so far, over all epochs."""
        return self.epoch * self.units_per_epoch + self.cursor * self.batch_size

    def next_units(self) -> np.ndarray:
        """The unit indices of this rank's next batch; moves to the next epoch after the last one."""
        b = self.batch_size
        units = self.rank_order(self.epoch)[self.cursor * b:(self.cursor + 1) * b]
        self.cursor += 1
        if self.cursor == self.batches_per_epoch:
            self.epoch, self.cursor = self.epoch + 1, 0
        return units

    def eval_units(self, max_batches: int | None = None) -> Iterator[np.ndarray]:
        """One sequential pass over this rank's units (no shuffle), a batch at a time; the position is
        untouched."""
        units = self.rank_slice(np.arange(self.num_units))
        b = self.batch_size
        stop = len(units) if not self.drop_last else len(units) // b * b
        for k, i in enumerate(range(0, stop, b)):
            if max_batches is not None and k >= max_batches:
                return
            yield units[i:i + b]

    def rank_slice(self, order: np.ndarray) -> np.ndarray:
        """This rank's share of a global order: every world_size-th unit of it, trimmed evenly."""
        return order[: self.per_rank * self.world_size][self.rank::self.world_size]

    def rank_order(self, epoch: int) -> np.ndarray:
        """The units this rank visits in `epoch`, in order (cached for the current epoch)."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * SEED_STRIDE + epoch)
                order = torch.randperm(self.num_units, generator=g).numpy()
            else:
                order = np.arange(self.num_units)
            self._order = (epoch, self.rank_slice(order))
        return self._order[1]

    # ---- state --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """Position plus the settings it is only valid for; the same on every rank."""
        return {"epoch": self.epoch, "cursor": self.cursor, "batch_size": self.batch_size,
                "seed": self.seed, "world_size": self.world_size, "shuffle": int(self.shuffle),
                "drop_last": int(self.drop_last), **self.settings, self.count_key: self.num_units}

    def load_state_dict(self, sd: dict) -> None:
        """Resume at the position in `sd`; DataError if it was taken with other data or settings.

        A different world size or per-rank batch size (e.g. 2 ranks x 4 -> 1 rank x 8, the same global
        batch) is accepted when the global position (cursor * batch_size * world_size units into the
        epoch) is a whole number of new global batches; otherwise resume on the old layout.
        """
        checked = (*_OWN_CHECKED, *self.settings, self.count_key)
        missing = [k for k in (*_POSITION, *checked) if k not in sd]
        if missing:
            raise DataError(f"data loader state lacks {', '.join(missing)}; it is not a {self.kind} state "
                            "(was the run trained with another objective?)")
        mine = self.state_dict()
        differ = [f"{k} {int(sd[k])} -> {mine[k]}" for k in checked if int(sd[k]) != mine[k]]
        if differ:
            raise DataError(f"cannot resume the data loader: {'; '.join(differ)} (checkpoint -> now); "
                            f"resume with the same data, {', '.join(self.settings)} and seed")
        epoch, cursor = int(sd["epoch"]), int(sd["cursor"])
        old_ws, old_bs = int(sd["world_size"]), int(sd["batch_size"])
        cursor, rem = divmod(cursor * old_bs * old_ws, self.batch_size * self.world_size)
        if rem or cursor > self.batches_per_epoch or epoch < 0:
            raise DataError(
                f"cannot resume the data loader saved on world_size={old_ws} x batch_size={old_bs} at epoch "
                f"{epoch}, batch {int(sd['cursor'])} on world_size={self.world_size} x batch_size="
                f"{self.batch_size}: that position is not a whole number of global batches here; resume "
                "on the old layout"
            )
        if cursor == self.batches_per_epoch:
            epoch, cursor = epoch + 1, 0
        self.epoch, self.cursor = epoch, cursor
