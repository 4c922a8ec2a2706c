"""T5's span corruption (Raffel et al. 2020, section 3.1.4) of an encoder-decoder (model.arch=t5) on the
pretraining data.

`batch_of` turns each window of the token stream (a TokenBatch from the ordinary TokenLoader; its
next-token targets are not used) into a Seq2SeqBatch, as T5's `span_corruption` preprocessor does:
`random_spans_noise_mask` picks round(T * noise_density) noise tokens (at least 1, at most T-1) in
round(noise / mean_noise_span_length) spans (at least 1), the window alternating non-noise and noise
spans, non-noise first; the encoder reads the non-noise tokens with sentinel k (`<extra_id_k>`) in place
of noise span k, then EOS; the decoder predicts sentinel k followed by noise span k for every k, then EOS.
Both lengths depend on T only (T - noise + spans + 1 and noise + spans + 1), so the batch has no padding.
The loss is the cross-entropy summed over the decoder's targets; metric `accuracy` counts them predicted
right (argmax).

Where the randomness comes from: each window's spans are drawn from a generator seeded with a hash of
(span_corruption.seed, the window's tokens), as objective mlm seeds its masks, so a killed and resumed
run, another world size or micro-batch split and every validation pass see exactly the same spans, with no
RNG state to checkpoint and no draw from the global RNG.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.batch import TokenBatch
from lmforge.data.seq2seq import Seq2SeqBatch, sentinel_ids
from lmforge.engine.objectives.base import Objective, ObjectiveOutput
from lmforge.errors import ConfigError


def span_counts(length: int, noise_density: float, mean_span: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a window of `length` tokens, T5's rounding (half to even) and bounds."""
    noise = int(np.round(length * noise_density))
    noise = min(max(noise, 1), length - 1)
    spans = max(int(np.round(noise / mean_span)), 1)
    return noise, spans


def _segmentation(items: int, segments: int, g: torch.Generator) -> np.ndarray:
    """Lengths of a random partition of `items` into `segments` non-empty runs (T5's _random_segmentation:
    a shuffled marker of the segment starts)."""
    first = np.zeros(items, dtype=bool)
    first[1:][torch.randperm(items - 1, generator=g).numpy() < segments - 1] = True
    return np.bincount(np.cumsum(first), minlength=segments)


def random_spans_noise_mask(length: int, noise_density: float, mean_span: float,
                            g: torch.Generator) -> np.ndarray:
    """(length,) bool, True on noise: T5's random_spans_noise_mask, drawn from `g`."""
    noise, spans = span_counts(length, noise_density, mean_span)
    # A very short window could ask for more spans than it has tokens of a kind (T5's own code would fail
    # there); never for T5's settings past a few tokens.
    spans = min(spans, noise, length - noise)
    noise_lengths = _segmentation(noise, spans, g)
    keep_lengths = _segmentation(length - noise, spans, g)
    interleaved = np.stack([keep_lengths, noise_lengths], axis=1).reshape(-1)  # keep, noise, keep, ...
    starts = np.zeros(length, dtype=np.int64)
    starts[np.cumsum(interleaved)[:-1]] = 1
    return np.cumsum(starts) % 2 == 1


def corrupt(row: np.ndarray, is_noise: np.ndarray, sentinels: list[int],
            eos: int) -> tuple[list[int], list[int]]:
    """(encoder input, decoder target) of one window: noise span k -> sentinel k in the input; the target
    lists sentinel k then span k for every k; both end with EOS."""
    starts = is_noise & ~np.concatenate([[False], is_noise[:-1]])  # first token of each noise span
    span = np.cumsum(starts) - 1  # the span index of each noise token
    if int(starts.sum()) > len(sentinels):
        raise ConfigError(f"span_corruption: a window of {len(row)} tokens has {int(starts.sum())} spans but "
                          f"the tokenizer has {len(sentinels)} sentinels <extra_id_k>; shorten train.seq_len "
                          "or raise span_corruption.mean_noise_span_length")
    inputs, targets = [], []
    for i, tok in enumerate(row.tolist()):
        if not is_noise[i]:
            inputs.append(tok)
            continue
        if starts[i]:
            inputs.append(sentinels[span[i]])
            targets.append(sentinels[span[i]])
        targets.append(tok)
    return inputs + [eos], targets + [eos]


class SpanCorruption(Objective):
    name = "span_corruption"
    batch_type = Seq2SeqBatch
    supports_pipeline = False  # the encoder-decoder has no pipeline stages

    def __init__(self, noise_density: float = 0.15, mean_noise_span_length: float = 3.0, seed: int = 0,
                 decoder_start: int = 0) -> None:
        if not 0 < noise_density < 1 or mean_noise_span_length < 1:
            raise ConfigError(f"span_corruption: noise_density={noise_density} must lie in (0, 1) and "
                              f"mean_noise_span_length={mean_noise_span_length} be >= 1")
        self.noise_density, self.mean_span, self.seed = noise_density, mean_noise_span_length, seed
        self.decoder_start = decoder_start
        self.sentinels: list[int] | None = None  # <extra_id_k> ids: set by `bind`
        self.eos: int | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> SpanCorruption:
        s = cfg.span_corruption
        obj = cls(s.noise_density, s.mean_noise_span_length, cfg.run.seed if s.seed is None else s.seed,
                  cfg.model.decoder_start_token_id)
        obj.check_lengths(cfg.seq_len, cfg.model.max_seq_len)
        return obj

    def lengths(self, window: int) -> tuple[int, int]:
        """(encoder input, decoder target) lengths of a window of `window` tokens."""
        noise, spans = span_counts(window, self.noise_density, self.mean_span)
        spans = min(spans, noise, window - noise)
        return window - noise + spans + 1, noise + spans + 1

    def check_lengths(self, window: int, max_seq_len: int) -> None:
        if window < 2:
            raise ConfigError(f"span_corruption needs windows of at least 2 tokens: train.seq_len={window}")
        enc, dec = self.lengths(window)
        if max(enc, dec) > max_seq_len:
            raise ConfigError(f"span_corruption of train.seq_len={window} gives encoder inputs of {enc} and "
                              f"targets of {dec} tokens, more than model.max_seq_len={max_seq_len}: raise "
                              "max_seq_len or lower seq_len")

    def bind(self, tokenizer: Any) -> SpanCorruption:
        """Take the sentinel and end-of-text ids from the run's tokenizer (an lmforge Tokenizer)."""
        ids = None if tokenizer is None else sentinel_ids(tokenizer)
        if ids is None:
            raise ConfigError("objective span_corruption needs T5's sentinels <extra_id_0>, <extra_id_1>, "
                              "... in the tokenizer; `lmforge prepare` adds them for model.arch=t5: prepare "
                              "the data with that config (a new data.dir), or use a T5 tokenizer")
        self.sentinels, self.eos = ids, tokenizer.eos_id
        return self

    def row_seed(self, row: np.ndarray) -> int:
        """The seed of one window's spans: a hash of (span_corruption.seed, the window's tokens)."""
        h = hashlib.blake2b(row.astype(np.int64).tobytes(), digest_size=8, key=str(self.seed).encode())
        return int.from_bytes(h.digest(), "little") & (2**63 - 1)

    def batch_of(self, raw: Any) -> Seq2SeqBatch:
        if isinstance(raw, Seq2SeqBatch):
            return raw
        assert self.sentinels is not None and self.eos is not None, "SpanCorruption.bind(tokenizer) first"
        ids = TokenBatch.of(raw).input_ids
        host = ids.cpu().numpy()
        inputs, targets = [], []
        for row in host:
            g = torch.Generator().manual_seed(self.row_seed(row))
            mask = random_spans_noise_mask(len(row), self.noise_density, self.mean_span, g)
            x, y = corrupt(row, mask, self.sentinels, self.eos)
            inputs.append(x)
            targets.append(y)
        x = torch.tensor(inputs, dtype=torch.long)
        y = torch.tensor(targets, dtype=torch.long)
        return Seq2SeqBatch(x.to(ids.device), y.to(ids.device), n_targets=y.numel(),
                            source_tokens=ids.numel())

    def num_targets(self, batch: Seq2SeqBatch) -> int:
        return batch.target_count()

    def target_ids(self, batch: Seq2SeqBatch) -> None:
        return None  # sentinels and spans out of order: bits per byte of the text has no meaning here

    def __call__(self, model: nn.Module, batch: Seq2SeqBatch) -> ObjectiveOutput:
        dec = batch.decoder_inputs(self.decoder_start)
        logits = model(batch.input_ids, dec, attention_mask=batch.attention_mask)  # (B, L, V)
        flat, targets = logits.flatten(0, 1), batch.targets.flatten()
        loss = F.cross_entropy(flat.float(), targets, reduction="sum", ignore_index=-100)
        correct = (flat.detach().argmax(-1) == targets).sum().float()
        return ObjectiveOutput(loss, {"accuracy": correct})

    def check_model(self, model: nn.Module) -> None:
        if getattr(getattr(model, "cfg", None), "arch", None) != "t5":
            raise ConfigError("objective span_corruption trains an encoder-decoder: set model.arch=t5")
