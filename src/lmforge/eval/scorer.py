"""A model asked the three questions evaluation tasks ask, as lm-evaluation-harness asks them:

- `loglikelihood(pairs)`: the summed log-probability of each continuation given its context, and
  whether greedy decoding would have produced it (multiple choice, cloze);
- `rolling_loglikelihood(texts)`: the log-probability of whole texts, in windows of the context
  length (perplexity tasks);
- `generate_until(contexts, until, max_gen_toks)`: greedy continuations cut at the first stop string.

Tokenisation follows the harness's `TemplateLM` so that per-document numbers equal its `HFLM` on the
exported model: trailing spaces of a context move to the continuation, context + continuation is
encoded as one string and split after the context's tokens, an empty context is the end-of-text
token, and an over-long input is cut from the left. Batches are right-padded (the model is causal:
padding after a row changes nothing before it).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import LmforgeError
from lmforge.models.generation import sample_replies


class RequestError(LmforgeError):
    """A request that cannot be scored; `index` is its position in the call's list."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


class Scorer:
    """`model` (an lmforge causal LM, logits (B, T, V)) with its tokenizer.

    max_length: the longest input (default: the model's max_seq_len); batch_size: rows per forward;
    autocast: a context manager factory for the forwards (the run's precision); chat: prompts are
    rendered conversations, whose control tokens (`<|im_start|>`...) are tokens, as transformers
    encodes a chat template's text, and generations also stop at `stops` (the template's end of turn)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        *,
        device: torch.device | str | None = None,
        max_length: int | None = None,
        batch_size: int = 16,
        autocast=None,
        chat: bool = False,
        stops: set[int] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.max_length = max_length or model.cfg.max_seq_len
        self.batch_size = batch_size
        self._autocast = autocast or contextlib.nullcontext
        self.chat = chat
        self.stops = {tokenizer.eos_id} | set(stops or ())

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode_chat(text)[0] if self.chat else self.tokenizer.encode(text)

    # ------------------------------------------------------------------------------ tokenisation

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids as the harness splits them (see the module docstring)."""
        if context == "":
            cont = self.encode(continuation)
            eot = self.tokenizer.eos_id
            return ([eot], cont) if not cont or cont[0] != eot else (cont[:1], cont[1:])
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = self.encode(context + continuation)
        ctx = self.encode(context)
        return ctx, whole[len(ctx) :]

    # ------------------------------------------------------------------------------ log-likelihood

    @torch.no_grad()
    def loglikelihood_tokens(
        self, requests: Sequence[tuple[list[int], list[int]]]
    ) -> list[tuple[float, bool]]:
        """(sum of log p(continuation token), all of them greedy) per (context ids, continuation ids)."""
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        rows = []
        for i, (ctx, cont) in enumerate(requests):
            if not ctx or not cont:
                raise RequestError("the continuation is empty: there is nothing to score", i)
            if len(cont) > self.max_length:
                raise RequestError(
                    f"a continuation of {len(cont)} tokens is longer than the model's context "
                    f"({self.max_length} tokens): it cannot be scored",
                    i,
                )
            ids = (ctx + cont)[-(self.max_length + 1) :][:-1]  # the last token is only a target
            rows.append((i, ids, cont))
        rows.sort(key=lambda r: -len(r[1]))  # longest first: batches of similar length
        with self._eval_mode():
            for start in range(0, len(rows), self.batch_size):
                chunk = rows[start : start + self.batch_size]
                width = len(chunk[0][1])
                x = torch.zeros(len(chunk), width, dtype=torch.long)
                for j, (_, ids, _) in enumerate(chunk):
                    x[j, : len(ids)] = torch.as_tensor(ids)
                with self._autocast():
                    logits = self.model(x.to(self.device))
                for j, (i, ids, cont) in enumerate(chunk):
                    n = len(cont)
                    rows_logits = logits[j, len(ids) - n : len(ids)]  # predicts cont[0..n-1]
                    if rows_logits.dtype in (torch.float16, torch.bfloat16):
                        rows_logits = rows_logits.float()
                    logp = F.log_softmax(rows_logits, dim=-1)
                    target = torch.as_tensor(cont, device=logp.device)
                    ll = float(logp.gather(1, target[:, None]).sum())
                    greedy = bool((logp.argmax(-1) == target).all())
                    out[i] = (ll, greedy)
        return out  # type: ignore[return-value]

    def loglikelihood(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy) for each (context, continuation) string pair."""
        return self.loglikelihood_tokens([self.encode_pair(c, x) for c, x in pairs])

    @torch.no_grad()
    def rolling_loglikelihood(self, texts: Sequence[str]) -> list[float]:
        """Log-probability of each whole text (the first token given the end-of-text token), scored in
        disjoint windows of max_length tokens, each window seeing the tokens before it up to the
        context length (the harness's rolling windows with context_len 1)."""
        requests = []
        owner = []
        for k, text in enumerate(texts):
            ids = self.tokenizer.encode(text)
            if not ids:
                raise LmforgeError(f"text {k} is empty: nothing to score")
            for ctx, cont in rolling_windows(ids, self.tokenizer.eos_id, self.max_length):
                requests.append((ctx, cont))
                owner.append(k)
        scores = self.loglikelihood_tokens(requests)
        totals = [0.0] * len(texts)
        for k, (ll, _) in zip(owner, scores):
            totals[k] += ll
        return totals

    # ------------------------------------------------------------------------------ generation

    def generate_until(
        self,
        contexts: Sequence[str],
        until: Sequence[str] = (),
        max_gen_toks: int = 256,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
    ) -> list[str]:
        """The continuation of each context, cut before the first of `until` (and the end-of-text
        token); at most `max_gen_toks` tokens (a generation that never stops ends there). Greedy at
        temperature 0; sampled otherwise, each batch from a generator seeded by (seed, its first
        context's index), so a run with the same seed and batch size draws the same samples."""
        if max_gen_toks < 1:
            raise LmforgeError("max_gen_toks must be at least 1")
        room = self.max_length - max_gen_toks
        if room < 1:
            raise LmforgeError(
                f"max_gen_toks={max_gen_toks} leaves no room for a prompt in the model's context "
                f"({self.max_length} tokens)"
            )
        stops = self.stops
        prompts = []
        for c in contexts:
            ids = self.encode(c) if c else [self.tokenizer.eos_id]
            prompts.append(ids[-room:])
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[str] = [""] * len(prompts)
        terms = [t for t in until if t]
        with self._autocast():
            for start in range(0, len(order), self.batch_size):
                idx = order[start : start + self.batch_size]
                done = None
                if terms:

                    def done(row: list[int]) -> bool:
                        text = self.tokenizer.decode(row)
                        return any(t in text for t in terms)

                generator = None
                if temperature > 0:
                    generator = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + min(idx))
                replies = sample_replies(
                    self.model,
                    [prompts[i] for i in idx],
                    max_gen_toks,
                    stops,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    generator=generator,
                    device=self.device,
                    is_done=done,
                )
                for i, reply in zip(idx, replies):
                    if reply and reply[-1] in stops:
                        reply = reply[:-1]
                    text = self.tokenizer.decode(reply)
                    for t in terms:
                        text = text.split(t)[0]
                    out[i] = text
        return out

    @contextlib.contextmanager
    def _eval_mode(self):
        was = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was)


def rolling_windows(ids: list[int], prefix_id: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) windows that score every token of `ids` once: the first window predicts
    ids[0 : max_length] from `prefix_id` onwards, each later one the next max_length tokens, its
    context the max_length tokens before them (lm-evaluation-harness's get_rolling_token_windows with
    context_len 1, made disjoint)."""
    windows = []
    first = ids[:max_length]
    windows.append(([prefix_id], first))
    pos = len(first)
    while pos < len(ids):
        cont = ids[pos : pos + max_length]
        ctx = ids[max(0, pos + len(cont) - max_length - 1) : pos]
        windows.append((ctx, cont))
        pos += len(cont)
    return windows


def perplexity_from(loglik: float, count: int) -> float:
    """exp(-loglik / count), capped to stay finite."""
    return math.exp(min(-loglik / max(count, 1), 700.0))
