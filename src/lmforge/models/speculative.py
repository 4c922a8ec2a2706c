"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023; transformers' assisted generation):
a cheap draft model proposes k tokens one at a time, the target scores all of them in one forward
over k + 1 positions, and an acceptance rule keeps a prefix of them plus one token of the target's
own, so each target forward yields between 1 and k + 1 tokens.

The rule makes the output the target's, not an approximation of it:
- greedy (temperature 0): a drafted token is kept while it equals the target's argmax, and the first
  mismatch is replaced by that argmax, so the tokens equal plain greedy decoding token for token;
- sampling: drafted token x ~ q is kept with probability min(1, p(x) / q(x)); on a rejection the
  token is drawn from norm(max(0, p - q)); when all k are kept a bonus token is drawn from p at the
  next position. Each emitted token then has exactly the target's distribution p. p and q are the
  target's and the draft's distributions after the same temperature / top-k / top-p filtering as
  plain sampling (`filter_logits`), as transformers does, so the output is distributed as plain
  sampling with those settings. The random stream differs, so a seed gives other (equally likely)
  samples than plain sampling with the same seed.

One sequence at a time (batch 1, as transformers' assisted generation). Both models keep a KVCache;
positions of rejected tokens are rolled back by lowering `cache.pos` (their buffers are overwritten
by the next forward).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from lmforge.errors import LmforgeError
from lmforge.models.common.attention import KVCache
from lmforge.models.common.rope import refuse_stale_cache
from lmforge.models.generation import filter_logits


@dataclass
class SpeculativeStats:
    """What one speculative_generate call did. `accepted` counts drafted tokens the target kept;
    every target forward adds one token of the target's own besides (a correction or a bonus)."""

    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0  # the prefill and one verification forward per round
    draft_forwards: int = 0
    rounds: int = 0
    seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens the target kept (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """New tokens per verification forward of the target (1 for plain decoding)."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, other: SpeculativeStats) -> None:
        """Accumulate another call's counts (several samples or prompts)."""
        for name in ("new_tokens", "drafted", "accepted", "target_forwards", "draft_forwards", "rounds",
                     "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate,
                "tokens_per_round": self.tokens_per_round, "tokens_per_s": self.tokens_per_s}

    def summary(self) -> str:
        return (f"speculative decoding: {self.accepted}/{self.drafted} drafted tokens accepted "
                f"({self.acceptance_rate:.1%}), {self.tokens_per_round:.2f} tokens per target forward, "
                f"{self.new_tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_s:.1f} tokens/s)")


def check_pair(target: nn.Module, draft: nn.Module) -> None:
    """LmforgeError unless draft and target score the same vocabulary (same vocab_size)."""
    vt, vd = target.cfg.vocab_size, draft.cfg.vocab_size
    if vt != vd:
        raise LmforgeError(
            f"the draft model's vocabulary ({vd} tokens) differs from the target's ({vt}); speculative "
            "decoding needs a draft with the same tokenizer (e.g. a smaller model trained on the target's "
            "prepared data, or the target itself quantized)"
        )


@torch.no_grad()
def speculative_generate(
    target: nn.Module,
    draft: nn.Module,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    k: int = 4,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stops: set[int] | frozenset[int] = frozenset(),
    device: torch.device | str | None = None,
    adaptive_k: bool = False,
) -> tuple[list[int], SpeculativeStats]:
    """Continue `prompt_ids` with `target`, `draft` proposing up to k tokens per target forward.

    Returns (new tokens, stats). The tokens end after the first stop token (kept) or at max_new_tokens
    or the target's max_seq_len, as `lmforge.eval.generate.generate`; with temperature 0 they equal its
    greedy output, otherwise they are distributed as its samples (see the module docstring).
    adaptive_k: transformers' heuristic, k + 2 after a round that kept every drafted token, k - 1
    (at least 1) after one that did not. Both models run in eval mode; their modes are restored.
    """
    check_pair(target, draft)
    if k < 1:
        raise LmforgeError(f"the number of drafted tokens per round (k) must be >= 1, got {k}")
    if temperature < 0:
        raise LmforgeError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    prompt = [int(t) for t in prompt_ids]
    max_len = target.cfg.max_seq_len
    if not prompt:
        raise LmforgeError("speculative decoding needs a non-empty prompt (at least one token id, e.g. BOS)")
    if len(prompt) >= max_len:
        raise LmforgeError(f"prompt of {len(prompt)} tokens leaves no room to generate: "
                           f"model.max_seq_len={max_len}; shorten the prompt")
    stats = SpeculativeStats()
    steps = min(max_new_tokens, max_len - len(prompt))
    if steps <= 0:
        return [], stats
    for model in (target, draft):  # verification and drafting forwards span several new tokens
        refuse_stale_cache(model.cfg.rope_scaling, len(prompt) - 1, len(prompt) + steps,
                           "speculative decoding")
    param = next(target.parameters())
    device = torch.device(device) if device is not None else param.device
    t0 = time.perf_counter()
    modes = (target.training, draft.training)
    target.eval()
    draft.eval()
    try:
        out = _decode(target, draft, prompt, steps, k, temperature, top_k, top_p, generator, stops, device,
                      adaptive_k, stats)
    finally:
        target.train(modes[0])
        draft.train(modes[1])
    stats.new_tokens = len(out)
    stats.seconds = time.perf_counter() - t0
    return out, stats


def _dtype(model: nn.Module) -> torch.dtype:
    p = next(model.parameters())
    return p.dtype if p.is_floating_point() else torch.float32  # quantized weights: float32 activations


def _decode(target, draft, prompt, steps, k, temperature, top_k, top_p, generator, stops, device,
            adaptive_k, stats) -> list[int]:
    greedy = temperature == 0
    n_prompt = len(prompt)
    draft_room = min(draft.cfg.max_seq_len, n_prompt + steps)
    # Invariant between rounds: `seq` is prompt + output; the target's cache holds seq[:-1] (the last
    # token is fed with the drafts of the next round), the draft's cache a prefix of seq.
    t_cache = KVCache(target, 1, n_prompt + steps, device=device, dtype=_dtype(target))
    d_cache = KVCache(draft, 1, draft_room, device=device, dtype=_dtype(draft))
    seq = list(prompt)
    if n_prompt > 1:
        target(torch.tensor([prompt[:-1]], device=device), cache=t_cache)
        stats.target_forwards += 1

    def probs(logits: torch.Tensor) -> torch.Tensor:  # (n, V) -> filtered probabilities, float64
        return filter_logits(logits, temperature, top_k, top_p).softmax(-1).double()

    while len(seq) - n_prompt < steps:
        # Room: accepted + 1 tokens must fit in `steps`; the draft writes positions up to
        # len(seq) + k_now - 2 and must stay inside its own max_seq_len (k_now 0: a plain target step).
        k_now = max(0, min(k, steps - (len(seq) - n_prompt) - 1, draft_room - len(seq) + 1))
        drafted: list[int] = []
        q_rows: list[torch.Tensor] = []  # the draft's distribution of each drafted token (sampling)
        for _ in range(k_now):
            feed = (seq + drafted)[d_cache.pos:]  # what the draft has not seen yet (never empty)
            logits = draft(torch.tensor([feed], device=device), cache=d_cache)[0, -1:]  # (1, V)
            stats.draft_forwards += 1
            if greedy:
                tok = int(logits.argmax(-1))
            else:
                q = probs(logits)  # (1, V)
                tok = int(torch.multinomial(q, 1, generator=generator))
                q_rows.append(q[0])
            drafted.append(tok)
            if tok in stops:  # what follows a stop token is never emitted
                break
        stats.drafted += len(drafted)
        # One target forward over [last token, d1..dn]: row i scores the token after position i.
        base = len(seq) - 1  # position of seq[-1]
        assert t_cache.pos == base
        logits = target(torch.tensor([[seq[-1], *drafted]], device=device), cache=t_cache)[0]  # (n+1, V)
        stats.target_forwards += 1
        stats.rounds += 1
        n_ok, new = _verify(logits, drafted, q_rows, greedy, probs, generator)
        stats.accepted += n_ok
        emitted = drafted[:n_ok] + [new]
        # Roll back both caches to the kept tokens: the target holds seq + kept (the new token is
        # fed next round); the draft never holds more than that.
        t_cache.pos = base + 1 + n_ok
        d_cache.pos = min(d_cache.pos, base + 1 + n_ok)
        for tok in emitted:
            seq.append(tok)
            if tok in stops:
                return seq[n_prompt:]
        if adaptive_k and drafted:
            k = k + 2 if n_ok == len(drafted) else max(1, k - 1)
    return seq[n_prompt:]


def _verify(logits, drafted, q_rows, greedy, probs, generator) -> tuple[int, int]:
    """(drafted tokens kept, the target's next token) for target logits (n + 1, V) over the drafts."""
    if greedy:
        best = logits.argmax(-1).tolist()  # (n + 1,)
        n_ok = 0
        while n_ok < len(drafted) and drafted[n_ok] == best[n_ok]:
            n_ok += 1
        return n_ok, best[n_ok]
    p = probs(logits)  # (n + 1, V)
    for i, tok in enumerate(drafted):
        u = float(torch.rand((), generator=generator, dtype=torch.float64, device=p.device))
        # Keep with probability min(1, p/q); `<` so a token the target filtered out (p = 0) is never kept.
        if u * q_rows[i][tok] < p[i, tok]:
            continue
        residual = (p[i] - q_rows[i]).clamp(min=0)  # (V,)
        if not bool(residual.sum() > 0):  # p == q up to rounding: the rule reduces to sampling p
            residual = p[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    n = len(drafted)
    return n, int(torch.multinomial(p[n], 1, generator=generator))  # all kept: the bonus token
