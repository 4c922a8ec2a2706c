"""Prefix language modelling of a decoder (objective prefix_lm; the prefix LM of Raffel et al. 2020 sec.
3.2.1, UL2's S-denoiser): each document of a packed row is split into a prefix, attended both ways, and a
continuation, predicted token by token (causal attention that also sees the whole prefix); the loss is
the cross-entropy of the continuation only.

`batch_of` turns each window of the token stream (a TokenBatch from the ordinary TokenLoader) into a
`PrefixBatch`: the window's documents (split after each end-of-document token; a window that starts or
ends inside a document keeps that part as a document of its own) become segments that attention never
crosses, with positions restarting at 0 in each (as packed fine-tuning rows). A document of L positions
gets a prefix of P = round(f * L) positions, f uniform in [prefix_lm.min_fraction,
prefix_lm.max_fraction], P clamped to [1, max(1, L - 1)] so that at least one token is predicted.
Targets: the document's tokens from position P on (the position before the boundary predicts the first
continuation token: it sees the whole prefix and nothing after it); the end-of-document token's target,
the next document's first token, carries no loss.

Where the randomness comes from: each row's fractions are drawn, one per document in row order, from a
generator seeded with a hash of (prefix_lm.seed, the row's tokens and its last target), as objective mlm
draws its masks: a pure function of the data, so a resumed run, another world size or micro-batch split
and every validation pass see the same boundaries, with no RNG state to checkpoint.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from lmforge.data.batch import IGNORE_INDEX, PaddedRows, TokenBatch
from lmforge.engine.chunked_loss import chunked_linear_cross_entropy
from lmforge.engine.loss import logits_of, token_loss_sum
from lmforge.engine.objectives.base import ObjectiveOutput, TokenObjective
from lmforge.errors import ConfigError
from lmforge.models.common.prefix_masks import prefix_refusal


@dataclass(frozen=True)
class PrefixBatch(PaddedRows):
    """Rows of documents with a bidirectional part each: `input_ids`, `targets` (B, T) as in TokenBatch,
    `position_ids` (B, T) restarting at 0 in each document, `segment_ids` (B, T) the document of each
    position, `prefix_end` (B, T) the row index where the position's document's bidirectional part ends
    (the model's attention rule: models/common/prefix_masks.py)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    prefix_end: torch.Tensor
    real_tokens: int = 0
    n_targets: int | None = field(default=None, compare=False)

    def __iter__(self):
        return iter((self.input_ids, self.targets))

    def _map(self, fn) -> PrefixBatch:
        """The batch (of its own class) with `fn` applied to every tensor; the targets counted first."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        kw = {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        return type(self)(**{**kw, "n_targets": self.target_count()})  # counted while on the host

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PrefixBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PrefixBatch:
        return self._map(lambda t: t.pin_memory())

    def target_count(self) -> int:
        if self.n_targets is not None:
            return self.n_targets
        return int((self.targets != IGNORE_INDEX).sum())

    model_kwarg_names: ClassVar[tuple[str, ...]] = ("position_ids", "segment_ids", "prefix_end")

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """What the model's forward takes beside the ids."""
        return {"position_ids": self.position_ids, "segment_ids": self.segment_ids,
                "prefix_end": self.prefix_end}


def row_seed(seed: int, *parts: torch.Tensor) -> int:
    """A 63-bit seed from a hash of (seed, the tensors' values): the same for the same data."""
    h = hashlib.blake2b(digest_size=8, key=str(seed).encode())
    for p in parts:
        h.update(p.numpy().astype(np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)


def documents(ids: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T,) stream tokens -> (segment (T,), starts (n,), lengths (n,)): documents end after each `eos`."""
    is_eos = (ids == eos).long()
    seg = torch.cumsum(is_eos, 0) - is_eos  # (T,) end-of-document tokens belong to their document
    n = int(seg[-1]) + 1
    idx = torch.arange(ids.numel())
    starts = torch.full((n,), ids.numel(), dtype=torch.long).scatter_reduce(0, seg, idx, "amin")
    return seg, starts, torch.bincount(seg, minlength=n)


class PrefixLM(TokenObjective):
    name = "prefix_lm"
    batch_type = PrefixBatch
    supports_pipeline = False  # the mask and positions travel with the batch, which stages do not pass on

    def __init__(self, min_fraction: float = 0.0, max_fraction: float = 1.0, seed: int = 0,
                 chunk_tokens: int = 0) -> None:
        if not 0.0 <= min_fraction <= max_fraction <= 1.0:
            raise ConfigError(f"prefix_lm: min_fraction={min_fraction} and max_fraction={max_fraction} must "
                              "satisfy 0 <= min_fraction <= max_fraction <= 1")
        self.min_fraction, self.max_fraction, self.seed = min_fraction, max_fraction, seed
        self.chunk_tokens = chunk_tokens
        self.eos: int | None = None  # the tokenizer's end-of-document id: set by `bind`

    @classmethod
    def from_config(cls, cfg: Any) -> PrefixLM:
        p = cfg.prefix_lm
        return cls(p.min_fraction, p.max_fraction, cfg.run.seed if p.seed is None else p.seed,
                   cfg.train.loss_chunk_tokens)

    def bind(self, eos_id: int) -> PrefixLM:
        """Take the end-of-document id the documents of the stream are split at."""
        self.eos = int(eos_id)
        return self

    def layout(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One row: (T,) stream ids and next-token targets -> (targets, position_ids, segment_ids,
        prefix_end), each (T,), as the module docstring describes."""
        assert self.eos is not None, "PrefixLM.bind(eos_id) first"
        seg, starts, lengths = documents(ids, self.eos)
        g = torch.Generator().manual_seed(row_seed(self.seed, ids, targets[-1:]))
        lo, hi = self.min_fraction, self.max_fraction
        frac = lo + (hi - lo) * torch.rand(len(starts), generator=g)  # (n,) one per document
        P = torch.round(frac.double() * lengths).long()
        P = torch.minimum(P.clamp(min=1), (lengths - 1).clamp(min=1))  # (n,)
        prefix_end = (starts + P)[seg]  # (T,)
        idx = torch.arange(ids.numel())
        keep = (idx >= prefix_end - 1) & (ids != self.eos)  # from the last prefix position on, within a doc
        return torch.where(keep, targets, IGNORE_INDEX), idx - starts[seg], seg, prefix_end

    def batch_of(self, raw: Any) -> PrefixBatch:
        """A window of the token stream as a prefix-LM batch (its boundaries and targets)."""
        if isinstance(raw, PrefixBatch):
            return raw
        tb = TokenBatch.of(raw)
        ids, tgt = tb.input_ids.cpu(), tb.targets.cpu()
        rows = [self.layout(ids[b], tgt[b]) for b in range(ids.size(0))]
        t, pos, seg, end = (torch.stack(c) for c in zip(*rows, strict=True))
        batch = PrefixBatch(ids, t, pos, seg, end, ids.numel(), int((t != IGNORE_INDEX).sum()))
        return batch.to(tb.input_ids.device)

    # ---- loss ---------------------------------------------------------------------------------------

    def logits(self, model: nn.Module, batch: PrefixBatch) -> torch.Tensor:
        return logits_of(model(batch.input_ids, **batch.model_kwargs()))

    def __call__(self, model: nn.Module, batch: PrefixBatch) -> ObjectiveOutput:
        if self.chunk_tokens:
            targets, chunk = batch.targets, self.chunk_tokens

            def head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                return chunked_linear_cross_entropy(hidden, weight, targets, chunk, IGNORE_INDEX)

            return ObjectiveOutput(model(batch.input_ids, head=head, **batch.model_kwargs()), {})
        return ObjectiveOutput(token_loss_sum(self.logits(model, batch), batch.targets), {})

    def check_model(self, model: nn.Module) -> None:
        why = prefix_refusal(getattr(model, "cfg", None))
        if why is not None:
            raise ConfigError(f"objective {self.name}: {why}")
        params = inspect.signature(model.forward).parameters
        needed = (*self.batch_type.model_kwarg_names, *(("head",) if self.chunk_tokens else ()))
        if any(p not in params for p in needed):
            raise ConfigError(f"objective {self.name} needs a model whose forward takes {', '.join(needed)} "
                              f"(lmforge's Transformer); {type(model).__name__} does not")

    def stage_loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        # check_layout refuses parallel.pp > 1 for objectives without supports_pipeline before any step
        raise ConfigError(f"objective {self.name} does not run in a pipeline: set parallel.pp=1")
