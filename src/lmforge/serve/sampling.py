"""How the serving engine picks each choice's next token: the request's sampling parameters, the
generator of each choice, the logit bias and OpenAI's presence / frequency penalties, and the draw.

Temperature 0 is greedy argmax; otherwise lmforge.models.generation.sample_next with the request's
temperature / top-k / top-p and a generator per choice (seeded with seed + choice index when the
request gives a seed), drawn one row at a time, so a seeded reply does not depend on what else is
running. The engine (serve/engine.py) keeps what a row has generated; this module holds no state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmforge.models.generation import sample_next
from lmforge.serve.grammar import Grammar


@dataclass(frozen=True)
class SamplingParams:
    """How the choices of one request are sampled and when they end.

    max_tokens: tokens to generate at most (each choice is also capped by the model's context; 0: none).
    temperature 0 is greedy; top_k None and top_p 1.0 keep every token. n: choices per prompt.
    seed: choice j draws with a generator seeded seed + j (None: a random seed).
    stop: strings that end a reply (excluded from its text); stop_ids: token ids that do (EOS,
    end of turn; excluded from the text, counted as generated tokens). grammar: each choice's tokens
    are masked to what it allows (serve/grammar.py), the stop ids only once it is complete, and the
    reply ends with "stop" when nothing else may follow. logit_bias: (token id, bias) added to that
    token's logit at every step; presence_penalty / frequency_penalty: subtracted from the logit of
    each token the choice has generated, once / once per time (OpenAI's definitions; the model's raw
    logits are what logprobs report)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()
    # log-probabilities (lmforge.serve.logprobs): None reports none (and computes none); k reports the
    # chosen token's with the k most likely. prompt_logprobs: the prompt's tokens too (with
    # max_tokens 0: the prompt scored, nothing generated).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    adapter: Any = None  # the LoRA adapter (serve/adapters.py's Adapter) its rows decode with; None: the base
    grammar: Grammar | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def adjusts(self) -> bool:
        """Whether the logits are changed before sampling (bias or penalties)."""
        return bool(self.logit_bias) or self.penalises()

    def penalises(self) -> bool:
        """Whether the tokens a choice has generated are penalised (presence or frequency)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def choice_generator(params: SamplingParams, index: int, device: torch.device) -> torch.Generator | None:
    """The generator choice `index` (prompt * n + j) draws with: seeded seed + j when the request gives
    a seed, else randomly; None for a greedy request (argmax draws nothing)."""
    if params.temperature <= 0:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed + index % params.n)
    return gen


def token_counts(ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(V,) how many times each token occurs in `ids`: what the penalties of a choice start from."""
    counts = torch.zeros(vocab_size, device=device)
    for t in ids:
        counts[t] += 1
    return counts


def adjust_(logits: torch.Tensor, params: SamplingParams, bias: tuple[torch.Tensor, torch.Tensor] | None,
            counts: torch.Tensor | None) -> None:
    """One row's logits (V,), in place: plus the logit `bias` (token ids, values), minus the presence
    and frequency penalties of the tokens generated `counts` times (V,)."""
    if bias is not None:
        ids, values = bias
        logits[ids] += values.to(logits.dtype)
    if counts is not None:
        penalty = counts * params.frequency_penalty + (counts > 0) * params.presence_penalty
        logits -= penalty.to(logits.dtype)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """The next token of each row from its logits (B, V): greedy rows by argmax, the others with
    their own generator (one row at a time, so a draw does not depend on the batch)."""
    out = logits.argmax(dim=-1).tolist()
    for i, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature > 0:
            out[i] = int(sample_next(logits[i : i + 1], p.temperature, p.top_k, p.top_p, gen)[0])
    return out
