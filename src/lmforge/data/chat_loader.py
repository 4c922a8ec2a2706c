"""`ChatLoader`: fine-tuning batches from prepared SFT examples, resumable exactly.

With packing, the examples are put into rows of seq_len tokens once, by best-fit decreasing (longest
first, each into the fullest row it still fits; TRL's "bfd" strategy, which this reproduces row for
row), and the rows are then the units an epoch shuffles. Without packing each example is a unit, and a
batch is padded to its longest example. Epoch e visits the units in randperm order seeded with
seed * 1000003 + e; rank r of W takes every W-th unit (the order trimmed to a multiple of W): the
`EpochSampler` the TokenLoader uses for its windows.

Targets: position i of an example predicts its token i + 1 where that token carries the loss; the
last position of each example predicts nothing, so no row ever learns one conversation from another.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Iterator

import numpy as np
import torch

from lmforge.data.batch import IGNORE_INDEX, ChatBatch, PreferenceBatch, PromptBatch, UnpairedBatch
from lmforge.data.sampler import EpochSampler
from lmforge.data.sft import SFTSplit
from lmforge.errors import DataError


def pack_bfd(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
    """Rows of example indices whose lengths sum to at most seq_len, by best-fit decreasing.

    Longest first (ties in index order); each goes into the row with the least room that still fits
    it (of equally full rows, the one filled first), or starts a new row. Every length must be in
    [1, seq_len]."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    rows: list[list[int]] = []
    by_room: dict[int, deque[int]] = defaultdict(deque)  # room left -> rows with it, oldest first
    rooms: list[int] = []  # sorted distinct rooms that some row has (> 0)
    for i in order:
        n = int(lengths[i])
        if not 1 <= n <= seq_len:
            raise ValueError(f"example {i} has {n} tokens; packing needs 1..{seq_len}")
        k = bisect.bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            row = by_room[room].popleft()
            if not by_room[room]:
                rooms.pop(k)
        else:
            row, room = len(rows), seq_len
            rows.append([])
        rows[row].append(int(i))
        room -= n
        if room > 0:
            if not by_room[room]:
                bisect.insort(rooms, room)
            by_room[room].append(row)
    return rows


class ChatLoader:
    """`ChatBatch`es from one split of prepared SFT examples; Stateful like TokenLoader."""

    def __init__(
        self,
        split: SFTSplit,
        seq_len: int,
        batch_size: int,
        *,
        packing: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = True,
        pad_id: int = 0,
    ) -> None:
        if seq_len < 2 or batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"bad loader settings: seq_len={seq_len}, batch_size={batch_size}, "
                f"rank={rank}, world_size={world_size}"
            )
        self.split, self.seq_len, self.batch_size, self.seed = split, seq_len, batch_size, seed
        self.rank, self.world_size, self.shuffle, self.drop_last = rank, world_size, shuffle, drop_last
        self.packing, self.pad_id = packing, pad_id
        lengths = split.lengths
        if len(lengths) and int(lengths.max()) > seq_len:
            raise DataError(
                f"an example has {int(lengths.max())} tokens, more than seq_len={seq_len}: the "
                "data was prepared for a longer train.seq_len; prepare it again"
            )
        self.units: list[list[int]] = self._make_units(lengths)
        need = world_size * (batch_size if drop_last else 1)
        if len(self.units) < need:
            what = "packed rows" if packing else "conversations"
            raise DataError(
                f"the split has {len(split):,} conversations ({len(self.units):,} {what}); "
                f"batch_size={batch_size} on world_size={world_size} needs at least {need}: use "
                "more data or a smaller batch"
            )
        self.sampler = EpochSampler(len(self.units), batch_size, seed=seed, rank=rank, world_size=world_size,
                                    shuffle=shuffle, drop_last=drop_last, kind="ChatLoader",
                                    count_key="units",
                                    settings={"seq_len": seq_len, "packing": int(packing)})
        self.batches_per_epoch = self.sampler.batches_per_epoch

    def _make_units(self, lengths: np.ndarray) -> list[list[int]]:
        """What an epoch shuffles and a batch row holds: packed rows, or one example each."""
        return pack_bfd(lengths, self.seq_len) if self.packing else [[i] for i in range(len(lengths))]

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def cursor(self) -> int:
        """Batches taken in the current epoch (train.epochs validates when a pass ends)."""
        return self.sampler.cursor

    def next_batch(self) -> ChatBatch:
        return self.collate([self.units[int(u)] for u in self.sampler.next_units()])

    def __iter__(self) -> Iterator[ChatBatch]:
        while True:
            yield self.next_batch()

    def iter_eval_batches(self, max_batches: int | None = None) -> Iterator[ChatBatch]:
        """One sequential pass over this rank's units; the loader's state is untouched."""
        for units in self.sampler.eval_units(max_batches):
            yield self.collate([self.units[int(u)] for u in units])

    def collate(self, rows: list[list[int]]) -> ChatBatch:
        """The batch of `rows`, each a list of example indices (one per row without packing)."""
        width = self.seq_len if self.packing else max(int(self.split.lengths[r[0]]) for r in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        targets = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros((len(rows), width), dtype=np.int64)
        seg = np.full((len(rows), width), -1, dtype=np.int64)
        real = 0
        for r, row in enumerate(rows):
            at = 0
            for s, i in enumerate(row):
                x, m = self.split.example(i)
                n = len(x)
                ids[r, at : at + n] = x
                targets[r, at : at + n - 1] = np.where(m[1:], x[1:], IGNORE_INDEX)
                pos[r, at : at + n] = np.arange(n)
                seg[r, at : at + n] = s
                at += n
            real += at
        t = torch.from_numpy
        if not self.packing:
            return ChatBatch(t(ids), t(targets), real_tokens=real)
        return ChatBatch(t(ids), t(targets), t(pos), t(seg), real)

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.sampler.load_state_dict(sd)

    def _rank_units(self, epoch: int) -> np.ndarray:
        """The units this rank visits in `epoch`, in order."""
        return self.sampler.rank_order(epoch)


class PreferenceLoader(ChatLoader):
    """`PreferenceBatch`es of `batch_size` pairs from a prepared preference split, whose examples are
    (chosen, rejected) back to back: example 2i is pair i's chosen sequence, 2i+1 its rejected one.
    A pair is the unit an epoch shuffles; a batch is right-padded to its longest sequence, chosen rows
    first. Stateful and resumable exactly, as ChatLoader."""

    def __init__(self, split: SFTSplit, seq_len: int, batch_size: int, margins: list | None = None,
                 ref_logps: np.ndarray | None = None, **kw) -> None:
        if len(split) % 2:
            raise DataError(f"a preference split holds chosen/rejected example pairs; it has {len(split)} "
                            "examples")
        if margins is not None and len(margins) != len(split) // 2:
            raise DataError(f"the preference split has {len(split) // 2} pairs but {len(margins)} margins; "
                            "prepare the data again")
        # each pair's margin (reward models), 0 for a pair without one; None when no pair has one
        self.margins = None
        if margins is not None and any(m is not None for m in margins):
            self.margins = np.asarray([0.0 if m is None else float(m) for m in margins], dtype=np.float32)
        if ref_logps is not None and tuple(ref_logps.shape) != (len(split) // 2, 2):
            raise DataError(f"reference log-probs of shape {tuple(ref_logps.shape)} for {len(split) // 2} "
                            "pairs")
        self.ref_logps = ref_logps  # (pairs, 2): the reference model's (chosen, rejected), computed ahead
        super().__init__(split, seq_len, batch_size, packing=False, **kw)

    def _make_units(self, lengths: np.ndarray) -> list[list[int]]:
        return [[i, i + 1] for i in range(0, len(lengths), 2)]

    def collate(self, rows: list[list[int]]) -> PreferenceBatch:  # type: ignore[override]
        order = [pair[0] for pair in rows] + [pair[1] for pair in rows]  # chosen rows, then rejected
        width = max(int(self.split.lengths[i]) for i in order)
        ids = np.full((len(order), width), self.pad_id, dtype=np.int64)
        targets = np.full((len(order), width), IGNORE_INDEX, dtype=np.int64)
        real = 0
        for r, i in enumerate(order):
            x, m = self.split.example(i)
            n = len(x)
            ids[r, :n] = x
            targets[r, : n - 1] = np.where(m[1:], x[1:], IGNORE_INDEX)
            real += n
        margins = refs = None
        pairs = [pair[0] // 2 for pair in rows]
        if self.margins is not None:
            margins = torch.from_numpy(self.margins[pairs])
        if self.ref_logps is not None:
            refs = torch.from_numpy(np.concatenate([self.ref_logps[pairs, 0], self.ref_logps[pairs, 1]]))
        return PreferenceBatch(torch.from_numpy(ids), torch.from_numpy(targets), ref_logps=refs,
                               real_tokens=real, margins=margins)


class PromptLoader(ChatLoader):
    """`PromptBatch`es of `batch_size` RL prompts from a prepared prompt split and each prompt's record
    info. A prompt is the unit an epoch shuffles. Each batch carries a seed drawn from (seed, rank,
    epoch, position), which fixes the completions sampled for it: a resumed run samples the same.
    Stateful and resumable exactly, as ChatLoader."""

    def __init__(self, split: SFTSplit, info: list[dict], seq_len: int, batch_size: int, **kw) -> None:
        if len(info) != len(split):
            raise DataError(f"the prompt split has {len(split)} prompts but {len(info)} answers; prepare the "
                            "data again")
        self.info = info
        super().__init__(split, seq_len, batch_size, packing=False, **kw)

    def next_batch(self) -> PromptBatch:
        key = [self.seed, self.rank, self.sampler.epoch, self.sampler.cursor]
        batch = super().next_batch()
        seed = int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0] >> np.uint64(1))
        return PromptBatch(batch.prompts, batch.info, seed)

    def iter_eval_batches(self, max_batches: int | None = None) -> Iterator[PromptBatch]:
        """One sequential pass over this rank's prompts, each to be answered greedily."""
        for batch in super().iter_eval_batches(max_batches):
            yield PromptBatch(batch.prompts, batch.info, batch.seed, greedy=True)

    def collate(self, rows: list[list[int]]) -> PromptBatch:  # type: ignore[override]
        prompts = tuple(tuple(int(t) for t in self.split.example(r[0])[0]) for r in rows)
        return PromptBatch(prompts, tuple(self.info[r[0]] for r in rows), self.seed)


class UnpairedLoader(ChatLoader):
    """`UnpairedBatch`es of `batch_size` KTO examples (prompt + completion, loss on the completion) and
    each one's label. An example is the unit an epoch shuffles; each batch also holds, for example i,
    its prompt followed by example i-1's completion (the batch's last for the first), cut to seq_len:
    the mismatched pairs whose log-ratio is KTO's reference point. Stateful and resumable, as
    ChatLoader."""

    def __init__(self, split: SFTSplit, labels: list[bool], seq_len: int, batch_size: int, **kw) -> None:
        if len(labels) != len(split):
            raise DataError(f"the unpaired split has {len(split)} examples but {len(labels)} labels; prepare "
                            "the data again")
        self.labels = np.asarray(labels, dtype=bool)
        super().__init__(split, seq_len, batch_size, packing=False, **kw)

    def collate(self, rows: list[list[int]]) -> UnpairedBatch:  # type: ignore[override]
        parts = []
        for r in rows:
            x, m = self.split.example(r[0])
            start = int(np.argmax(m)) if m.any() else len(x)  # the first completion token
            parts.append((x[:start], x[start:]))
        seqs = list(parts)
        seqs += [(parts[i][0], parts[i - 1][1]) for i in range(len(parts))]  # mismatched: KL estimate
        width = min(self.seq_len, max(len(p) + len(c) for p, c in seqs))
        ids = np.full((len(seqs), width), self.pad_id, dtype=np.int64)
        targets = np.full((len(seqs), width), IGNORE_INDEX, dtype=np.int64)
        real = 0
        for r, (p, c) in enumerate(seqs):
            x = np.concatenate([p, c])[:width]
            n = len(x)
            ids[r, :n] = x
            # position k predicts x[k + 1]; completion tokens start at len(p)
            k = np.arange(n - 1)
            targets[r, : n - 1] = np.where(k + 1 >= len(p), x[1:], IGNORE_INDEX)
            real += n
        labels = torch.from_numpy(self.labels[[r[0] for r in rows]])
        return UnpairedBatch(torch.from_numpy(ids), torch.from_numpy(targets), labels, real_tokens=real)
