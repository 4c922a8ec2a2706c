"""T5's span corruption (Raffel et al. 2020, section 3.1.4), as t5.data.preprocessors.span_corruption
defines it: of a window of `length` tokens, round(length * noise_density) become noise, grouped into
round(noise / mean_noise_span_length) spans placed by `random_spans_noise_mask`; the input keeps the
other tokens with each noise span replaced by one sentinel, the target is the noise spans each led by
its sentinel (the kept spans replaced by sentinels, as T5's noise_span_to_unique_sentinel does for the
target), both ended by EOS. Sentinel k is `<extra_id_k>`: T5 numbers them down from the vocabulary's
end; here the caller passes their ids, so any tokenizer with sentinel tokens works.

Randomness: each window's mask comes from a generator seeded by a hash of (seed, the window's tokens),
like the masked-LM objective's (engine/objectives/mlm.py): the corruption is a function of the data, so
resume, any data-parallel layout and every validation pass see the same spans, with no RNG state.
"""

from __future__ import annotations

import hashlib

import numpy as np

from lmforge.errors import ConfigError


def random_spans_noise_mask(length: int, noise_density: float, mean_noise_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
    """(length,) bool, True = noise: T5's random_spans_noise_mask. The sequence starts with a kept span;
    kept and noise spans alternate; span lengths are a uniformly random segmentation (each of the
    C(n-1, k-1) splits of n items into k non-empty parts equally likely)."""
    if length < 2:
        raise ConfigError(f"span corruption needs windows of at least 2 tokens, got {length}")
    num_noise = int(round(length * noise_density))
    num_noise = min(max(num_noise, 1), length - 1)  # at least one noise and one kept token
    num_spans = max(int(round(num_noise / mean_noise_span_length)), 1)
    num_kept = length - num_noise

    def segmentation(num_items: int, num_segments: int) -> np.ndarray:
        # num_segments - 1 cut points among the num_items - 1 gaps, chosen by a shuffle
        first = np.zeros(num_items, dtype=np.int64)
        cuts = rng.permutation(num_items - 1) < num_segments - 1
        first[1:] = cuts
        return np.bincount(np.cumsum(first), minlength=num_segments)  # (num_segments,) lengths

    noise_lengths, kept_lengths = segmentation(num_noise, num_spans), segmentation(num_kept, num_spans)
    interleaved = np.stack([kept_lengths, noise_lengths], axis=1).reshape(-1)  # kept, noise, kept, ...
    starts = np.cumsum(interleaved)[:-1]
    indicator = np.zeros(length, dtype=np.int64)
    indicator[starts] = 1
    return np.cumsum(indicator) % 2 == 1


def sentinel_spans(tokens: np.ndarray, noise: np.ndarray, sentinels: np.ndarray) -> np.ndarray:
    """T5's noise_span_to_unique_sentinel: each run of `noise` positions becomes the next sentinel
    (sentinels[0], sentinels[1], ...), the other tokens stay."""
    starts = noise & ~np.concatenate([[False], noise[:-1]])
    span = np.cumsum(starts) - 1  # index of the span each noise position is in
    out = tokens.copy()
    out[starts] = sentinels[span[starts]]
    return out[~noise | starts]


def corrupt(tokens: np.ndarray, noise: np.ndarray, sentinels: np.ndarray, eos: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of one window: inputs keep the kept tokens, targets the noise ones, each with
    the other side's spans as sentinels, then EOS."""
    starts = np.concatenate([[True], noise[1:] != noise[:-1]])  # the first position of every span
    spans = int(max((starts & noise).sum(), (starts & ~noise).sum()))  # sentinels each side needs
    if spans > len(sentinels):
        raise ConfigError(f"span corruption made {spans} noise spans but the tokenizer has {len(sentinels)} "
                          "sentinel tokens: add more <extra_id_k> tokens or use shorter windows")
    inputs = np.append(sentinel_spans(tokens, noise, sentinels), eos)
    targets = np.append(sentinel_spans(tokens, ~noise, sentinels), eos)
    return inputs, targets


def window_rng(seed: int, tokens: np.ndarray) -> np.random.Generator:
    """The generator of one window's mask: seeded by (seed, its tokens) alone."""
    digest = hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int64).tobytes(),
                             key=int(seed).to_bytes(8, "little", signed=True), digest_size=16).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little")))


def span_corrupt(tokens: np.ndarray, sentinels: np.ndarray, eos: int, seed: int,
                 noise_density: float = 0.15, mean_noise_span_length: float = 3.0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """One window of raw tokens -> (inputs, targets), the mask seeded by the window's content."""
    noise = random_spans_noise_mask(len(tokens), noise_density, mean_noise_span_length,
                                    window_rng(seed, tokens))
    return corrupt(np.asarray(tokens, dtype=np.int64), noise, np.asarray(sentinels, dtype=np.int64), eos)


def input_and_target_lengths(inputs_length: int, noise_density: float = 0.15,
                             mean_noise_span_length: float = 3.0) -> tuple[int, int]:
    """(raw window length, target length) such that a window of that many raw tokens corrupts into at
    most `inputs_length` input tokens (EOS included): T5's random_spans_helper, whose search this is."""

    def lengths(raw: int) -> tuple[int, int]:
        noise = int(round(raw * noise_density))
        kept = raw - noise
        spans = int(round(noise / mean_noise_span_length))
        return kept + spans + 1, noise + spans + 1

    raw = inputs_length - 1
    while lengths(raw + 1)[0] <= inputs_length:
        raw += 1
    targets = lengths(raw)[1]
    if noise_density == 0.5 and targets > inputs_length:  # T5's own correction at density 0.5
        raw, targets = raw - 1, targets - 1
    return raw, targets
