"""Encoder-decoder batches and T5's sentinel tokens.

A Seq2SeqBatch holds the encoder's input rows and the decoder's target rows, which differ in length; the
decoder reads the targets shifted right behind its start token (teacher forcing), so the batch needs
nothing else. T5's sentinels `<extra_id_0>`, `<extra_id_1>`, ... stand for the spans span corruption
removes; `lmforge prepare` adds them to the tokenizer of a T5 run (model.arch=t5) in T5's order, the
highest id being `<extra_id_0>`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmforge.data.batch import IGNORE_INDEX

N_SENTINELS = 100  # T5's extra_ids
SENTINELS = tuple(f"<extra_id_{k}>" for k in range(N_SENTINELS))


def add_sentinels(tok) -> str:
    """Give an lmforge Tokenizer T5's sentinels (those it lacks; `<extra_id_0>` last, as T5 numbers them);
    returns the note `prepare` prints."""
    missing = [s for s in reversed(SENTINELS) if tok.token_id(s) is None]
    if not missing:
        return ""
    tok.add_special_tokens(missing)
    return f", {len(missing)} sentinels <extra_id_k> added"


def sentinel_ids(tok) -> list[int] | None:
    """The ids of `<extra_id_0>`, `<extra_id_1>`, ... that the tokenizer has (None: not even the first)."""
    ids = []
    for name in SENTINELS:
        i = tok.token_id(name)
        if i is None:
            break
        ids.append(i)
    return ids or None


@dataclass(frozen=True)
class Seq2SeqBatch:
    """`input_ids` (B, S): the encoder's rows; `targets` (B, L): what the decoder predicts, IGNORE_INDEX
    where nothing (padding); `attention_mask` (B, S) of 1/0 for padded encoder rows (None: none)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    attention_mask: torch.Tensor | None = None
    n_targets: int | None = field(default=None, compare=False)
    # the pretraining stream's tokens the rows were made from (span corruption), which throughput and
    # token budgets count as for every pretraining objective; None: the rows' own tokens
    source_tokens: int | None = field(default=None, compare=False)

    def target_count(self) -> int:
        if self.n_targets is not None:
            return self.n_targets
        return int((self.targets != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Seq2SeqBatch:
        count = self.n_targets if self.targets.device.type != "cpu" else self.target_count()
        mask = self.attention_mask
        mask = None if mask is None else mask.to(device, non_blocking=non_blocking)
        return Seq2SeqBatch(self.input_ids.to(device, non_blocking=non_blocking),
                            self.targets.to(device, non_blocking=non_blocking), mask, count,
                            self.source_tokens)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def num_tokens(self) -> int:
        """What throughput counts: the stream tokens the rows were made from, else the tokens the model
        reads (encoder inputs that are not padding, and decoder inputs that are not)."""
        if self.source_tokens is not None:
            return self.source_tokens
        enc = self.input_ids.numel() if self.attention_mask is None else int(self.attention_mask.sum())
        return enc + self.target_count()  # padded target positions are not read tokens

    @property
    def rows(self) -> int:
        return self.input_ids.size(0)

    def decoder_inputs(self, start: int) -> torch.Tensor:
        """(B, L) the targets shifted right behind `start`, ignored positions read as `start` (T5's
        _shift_right; such positions carry no loss)."""
        shifted = torch.cat([self.targets.new_full((self.rows, 1), start), self.targets[:, :-1]], dim=1)
        return shifted.masked_fill(shifted == IGNORE_INDEX, start)
