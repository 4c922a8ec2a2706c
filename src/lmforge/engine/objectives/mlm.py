"""Masked language modelling (BERT, RoBERTa) of an encoder (model.arch=encoder) on the pretraining data.

`batch_of` turns each window of the token stream (a TokenBatch from the ordinary TokenLoader) into a
masked one, the way the family frames sequences: [CLS] + the first T-2 tokens + [SEP], the stream's
end-of-document tokens becoming [SEP] (BERT's "[CLS] doc [SEP] doc [SEP]" packing). Of the positions
that are not special tokens, each is picked with probability mlm.mask_prob; a picked one becomes the
mask token (mlm.replace_prob), a random ordinary token (mlm.random_prob) or stays as it is, and is the
only kind of position with a target. The loss is the cross-entropy summed over the picked positions
(num_targets = their count, so accumulation and data parallelism are exact as for every objective);
metric `accuracy` is the fraction of them predicted right (argmax), in training and evaluation.

Where the randomness comes from: each row's mask is drawn from a generator seeded with a hash of
(mlm.seed, the row's tokens). The masks are therefore a pure function of the data: a killed and
resumed run, another world size or micro-batch split, and every validation pass see exactly the same
masks, with no RNG state to checkpoint and no draw from the global RNG (which dropout uses, and which
validation must not move). The price is BERT's static masking: a window seen in a later epoch gets the
mask it got before (RoBERTa's dynamic masking re-draws it; with one epoch or a few it makes no
difference to speak of, Liu et al. 2019 table 1).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.batch import IGNORE_INDEX, TokenBatch
from lmforge.engine.objectives.base import ObjectiveOutput, TokenObjective
from lmforge.errors import ConfigError


class MaskedLM(TokenObjective):
    name = "mlm"
    supports_pipeline = False  # the encoder has no pipeline stages

    def __init__(self, mask_prob: float = 0.15, replace_prob: float = 0.8, random_prob: float = 0.1,
                 seed: int = 0) -> None:
        if not 0 < mask_prob < 1 or replace_prob < 0 or random_prob < 0 or replace_prob + random_prob > 1:
            raise ConfigError(f"mlm: mask_prob={mask_prob} must lie in (0, 1) and "
                              f"replace_prob={replace_prob} + random_prob={random_prob} in [0, 1]")
        self.mask_prob, self.replace_prob, self.random_prob = mask_prob, replace_prob, random_prob
        self.seed = seed
        self.ids: dict[str, int] | None = None  # cls, sep, mask, pad, eos: set by `bind`
        self.special: torch.Tensor | None = None  # (S,) ids never picked
        self.random_ids: torch.Tensor | None = None  # (R,) ordinary ids a random replacement draws from

    @classmethod
    def from_config(cls, cfg: Any) -> MaskedLM:
        m = cfg.mlm
        return cls(m.mask_prob, m.replace_prob, m.random_prob, cfg.run.seed if m.seed is None else m.seed)

    def bind(self, tokenizer: Any) -> MaskedLM:
        """Take the special ids from the run's tokenizer (an lmforge Tokenizer): [CLS]/[SEP]/[MASK]/[PAD]
        or RoBERTa's <s>/</s>/<mask>/<pad>, its end-of-document id and every other special token."""
        enc = None if tokenizer is None else tokenizer.encoder_ids()
        if enc is None:
            raise ConfigError("objective mlm needs a tokenizer with [CLS] [SEP] [MASK] [PAD] (or <s> </s> "
                              "<mask> <pad>); `lmforge prepare` adds them for model.arch=encoder: prepare "
                              "the data with that config (a new data.dir), or use a BERT / RoBERTa "
                              "tokenizer")
        self.ids = {**enc, "eos": tokenizer.eos_id}
        special = {*enc.values(), tokenizer.eos_id}
        special |= {i for t in tokenizer.special_tokens() if (i := tokenizer.token_id(t)) is not None}
        self.special = torch.tensor(sorted(special), dtype=torch.long)
        ordinary = np.setdiff1d(np.arange(tokenizer.vocab_size), self.special.numpy())
        self.random_ids = torch.from_numpy(ordinary).long()
        return self

    # ---- masking ------------------------------------------------------------------------------------

    def frame(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) stream tokens -> (B, T) [CLS] + ids[:, :T-2] (end-of-document as [SEP]) + [SEP]."""
        assert self.ids is not None, "MaskedLM.bind(tokenizer) first"
        B, T = ids.shape
        if T < 3:
            raise ConfigError(f"objective mlm frames rows as [CLS] ... [SEP]: train.seq_len={T} leaves no "
                              "room; use at least 3")
        body = ids[:, : T - 2]
        body = torch.where(body == self.ids["eos"], self.ids["sep"], body)
        cls = body.new_full((B, 1), self.ids["cls"])
        sep = body.new_full((B, 1), self.ids["sep"])
        return torch.cat([cls, body, sep], dim=1)  # (B, T)

    def row_seed(self, row: torch.Tensor) -> int:
        """The seed of one row's mask: a hash of (mlm.seed, the row's tokens)."""
        data = row.numpy().astype(np.int64).tobytes()
        h = hashlib.blake2b(data, digest_size=8, key=str(self.seed).encode())
        return int.from_bytes(h.digest(), "little") & (2**63 - 1)

    def mask(self, ids: torch.Tensor) -> TokenBatch:
        """(B, T) framed ids -> TokenBatch(corrupted ids, targets: the original id where picked, else
        IGNORE_INDEX)."""
        assert self.special is not None and self.random_ids is not None
        host = ids.cpu()
        B, T = host.shape
        pick_u, kind_u = torch.empty(B, T), torch.empty(B, T)
        rnd = torch.empty(B, T, dtype=torch.long)
        for b in range(B):
            g = torch.Generator().manual_seed(self.row_seed(host[b]))
            pick_u[b] = torch.rand(T, generator=g)
            kind_u[b] = torch.rand(T, generator=g)
            rnd[b] = torch.randint(len(self.random_ids), (T,), generator=g)
        picked = (pick_u < self.mask_prob) & ~torch.isin(host, self.special)  # (B, T)
        to_mask = picked & (kind_u < self.replace_prob)
        to_random = picked & (kind_u >= self.replace_prob) & (kind_u < self.replace_prob + self.random_prob)
        inputs = torch.where(to_mask, self.ids["mask"], host)
        inputs = torch.where(to_random, self.random_ids[rnd], inputs)
        targets = torch.where(picked, host, IGNORE_INDEX)
        return TokenBatch(inputs.to(ids.device), targets.to(ids.device))

    def batch_of(self, raw: Any) -> TokenBatch:
        """A window of the token stream (its next-token targets are not used) as a masked, framed batch."""
        return self.mask(self.frame(TokenBatch.of(raw).input_ids))

    # ---- loss ---------------------------------------------------------------------------------------

    def __call__(self, model: nn.Module, batch: TokenBatch) -> ObjectiveOutput:
        picked = batch.targets != IGNORE_INDEX  # (B, T)
        logits = model(batch.input_ids, select=picked)  # (N, V): the picked positions only
        targets = batch.targets[picked]  # (N,)
        loss = F.cross_entropy(logits.float(), targets, reduction="sum")
        correct = (logits.detach().argmax(-1) == targets).sum().float()
        return ObjectiveOutput(loss, {"accuracy": correct})

    def check_model(self, model: nn.Module) -> None:
        cfg = getattr(model, "cfg", None)
        if getattr(cfg, "arch", None) != "encoder":
            raise ConfigError("objective mlm trains a bidirectional encoder: set model.arch=encoder (a "
                              "decoder sees only earlier tokens, so it cannot fill in a masked one)")

    def stage_loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        # check_layout refuses parallel.pp > 1 for objectives without supports_pipeline before any step
        raise ConfigError("objective mlm does not run in a pipeline: set parallel.pp=1")
