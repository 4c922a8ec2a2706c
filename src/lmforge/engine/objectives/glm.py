"""GLM's autoregressive blank infilling (Du et al. 2022, "GLM: General Language Model Pretraining with
Autoregressive Blank Infilling", sec. 2.1) of a decoder (objective glm) on the pretraining data.

`batch_of` turns each window of the token stream into a `GLMBatch`. The window's first S = T - 2K tokens
(K = max(1, ceil(glm.mask_prob * T / 2)) the most blanks a row may hold, since each blank adds two
positions: its [MASK] and its [START]) are split into documents after each end-of-document token, as
objective prefix_lm does. In each document, spans of lengths ~ Poisson(glm.mean_span) (at least 1) are
drawn until round(glm.mask_prob x its tokens) are covered (the end-of-document token is never covered;
no two spans touch; the row's K blanks are not exceeded), then:

- part A: the document with each span replaced by one [MASK] token; attended both ways;
- part B: the spans in a shuffled order, each as [START] + its tokens, predicting its tokens + [END]
  token by token; B attends causally over itself and sees all of A (so a span sees the spans before it).

Each document is laid out as A then B (segments that attention never crosses, as prefix_lm's documents);
the rest of the row is padding (segment -1, no target). Two positions per token (GLM's 2-D positions):
`position_ids` the position in part A (a part-B token: the position of its span's [MASK]), through the
model's own position encoding (RoPE or the learned table), and `block_position_ids` the position inside
the span (0 in part A, 1.. in part B), through a second learned table (model.block_position_embedding).
The loss is the cross-entropy summed over part B's targets.

The draws come from a generator seeded with a hash of (glm.seed, the row's S tokens): a pure function of
the data, so resume, world sizes and validation see the same blanks (as mlm's masks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lmforge.data.batch import IGNORE_INDEX, TokenBatch
from lmforge.engine.objectives.prefix_lm import PrefixBatch, PrefixLM, documents, row_seed
from lmforge.errors import ConfigError


@dataclass(frozen=True)
class GLMBatch(PrefixBatch):
    """A PrefixBatch (prefix_end: where each document's part A ends) with `block_position_ids` (B, T)."""

    block_position_ids: torch.Tensor | None = None
    model_kwarg_names: ClassVar[tuple[str, ...]] = (*PrefixBatch.model_kwarg_names, "block_position_ids")

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        return {**super().model_kwargs(), "block_position_ids": self.block_position_ids}


def sample_spans(n: int, mask_prob: float, mean_span: float, budget: int,
                 g: torch.Generator) -> list[tuple[int, int]]:
    """Spans (start, length), sorted, over n maskable tokens: lengths ~ max(1, Poisson(mean_span)) until
    round(mask_prob * n) tokens are covered, at most `budget` spans, none touching another."""
    target = round(mask_prob * n)
    lengths: list[int] = []
    while sum(lengths) < target and len(lengths) < budget:
        draw = int(torch.poisson(torch.tensor([mean_span]), generator=g).item())
        length = min(max(1, draw), target - sum(lengths))
        if len(lengths) + 1 > n - sum(lengths) - length + 1:  # no gap left to keep it apart from the others
            break
        lengths.append(length)
    if not lengths:
        return []
    kept = n - sum(lengths)  # the tokens left in part A, with len(lengths) distinct gaps among kept + 1
    slots = sorted(torch.randperm(kept + 1, generator=g)[: len(lengths)].tolist())
    spans, shift = [], 0
    for slot, length in zip(slots, lengths, strict=True):
        spans.append((slot + shift, length))
        shift += length
    return spans


def build_document(tokens: list[int], spans: list[tuple[int, int]], order: list[int],
                   ids: dict[str, int]) -> tuple[list[int], list[int], list[int], list[int], int]:
    """One document (tokens; spans (start, length) over them, sorted; the part-B order of the spans) ->
    (inputs, targets, positions, block positions, len(part A))."""
    inputs, mask_at, i = [], [], 0
    for start, length in spans:
        inputs += tokens[i:start]
        mask_at.append(len(inputs))
        inputs.append(ids["mask"])
        i = start + length
    inputs += tokens[i:]
    a = len(inputs)
    targets, pos, block = [IGNORE_INDEX] * a, list(range(a)), [0] * a
    for j in order:
        start, length = spans[j]
        span = tokens[start : start + length]
        inputs += [ids["start"], *span]
        targets += [*span, ids["end"]]
        pos += [mask_at[j]] * (length + 1)
        block += list(range(1, length + 2))
    return inputs, targets, pos, block, a


class GLM(PrefixLM):
    name = "glm"
    batch_type = GLMBatch

    def __init__(self, mask_prob: float = 0.15, mean_span: float = 3.0, seed: int = 0,
                 chunk_tokens: int = 0) -> None:
        super().__init__(seed=seed, chunk_tokens=chunk_tokens)
        if not 0 < mask_prob < 1 or mean_span <= 0:
            raise ConfigError(f"glm: mask_prob={mask_prob} must lie in (0, 1) and mean_span={mean_span} "
                              "be > 0")
        self.mask_prob, self.mean_span = mask_prob, mean_span
        self.ids: dict[str, int] | None = None  # mask, start, end: set by `bind_tokens`

    @classmethod
    def from_config(cls, cfg: Any) -> GLM:
        g = cfg.glm
        return cls(g.mask_prob, g.mean_span, cfg.run.seed if g.seed is None else g.seed,
                   cfg.train.loss_chunk_tokens)

    def bind_tokens(self, eos_id: int, mask_id: int, start_id: int, end_id: int) -> GLM:
        """The tokenizer's end-of-document, [MASK], [START] and [END] ids."""
        self.bind(eos_id)
        self.ids = {"mask": int(mask_id), "start": int(start_id), "end": int(end_id)}
        return self

    def blanks(self, T: int) -> int:
        """K: the most blanks a row of T positions holds (each adds a [MASK] and a [START])."""
        return max(1, math.ceil(self.mask_prob * T / 2))

    def row(self, ids: torch.Tensor) -> tuple[list[int], ...]:
        """One row: (T,) stream ids -> (inputs, targets, positions, block positions, segments,
        prefix ends), each T long (padded), as the module docstring describes."""
        assert self.ids is not None and self.eos is not None, "GLM.bind_tokens(...) first"
        T = ids.numel()
        K = self.blanks(T)
        src = ids[: T - 2 * K]
        g = torch.Generator().manual_seed(row_seed(self.seed, src))
        seg, starts, lengths = documents(src, self.eos)
        out: tuple[list[int], ...] = ([], [], [], [], [], [])
        for d, (s, L) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            tokens = src[s : s + L].tolist()
            n = L - int(tokens[-1] == self.eos)  # the end-of-document token stays in part A
            spans = sample_spans(n, self.mask_prob, self.mean_span, K, g)
            K -= len(spans)
            order = torch.randperm(len(spans), generator=g).tolist()
            inp, tgt, pos, blk, a = build_document(tokens, spans, order, self.ids)
            begin = len(out[0])
            for col, part in zip(out, (inp, tgt, pos, blk, [d] * len(inp), [begin + a] * len(inp)),
                                 strict=True):
                col.extend(part)
        pad = T - len(out[0])
        for col, value in zip(out, (self.eos, IGNORE_INDEX, 0, 0, -1, 0), strict=True):
            col.extend([value] * pad)
        return out

    def batch_of(self, raw: Any) -> GLMBatch:
        """A window of the token stream as a blank-infilling batch."""
        if isinstance(raw, GLMBatch):
            return raw
        tb = TokenBatch.of(raw)
        if tb.input_ids.size(1) < 8:
            raise ConfigError(f"objective glm needs room for part B: train.seq_len={tb.input_ids.size(1)} is "
                              "too short; use at least 8")
        rows = [self.row(r) for r in tb.input_ids.cpu()]
        inp, tgt, pos, blk, seg, end = (torch.tensor(c, dtype=torch.long) for c in zip(*rows, strict=True))
        real = int((seg >= 0).sum())
        batch = GLMBatch(inp, tgt, pos, seg, end, real, int((tgt != IGNORE_INDEX).sum()), blk)
        return batch.to(tb.input_ids.device)

    # The loss (PrefixLM.__call__, the batch's model_kwargs carrying the block positions) is prefix_lm's.

    def check_model(self, model: nn.Module) -> None:
        super().check_model(model)
        if not getattr(getattr(model, "cfg", None), "block_position_embedding", False):
            raise ConfigError("objective glm adds GLM's second (intra-span) position to the embeddings: "
                              "set model.block_position_embedding=true (a learned table of "
                              "model.max_seq_len rows)")
