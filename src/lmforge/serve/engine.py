"""The generation engine behind `lmforge serve`: one thread owns the model and decodes every running
sequence together, one token per step (continuous batching); no HTTP here.

Requests are queued by `Engine.submit` from any thread. Between two decode steps the engine admits
waiting sequences while a batch slot is free: it runs the prompt alone through the model (its
prefill, shared by the `n` choices of one prompt), copies its keys/values into a free slot of the
batch cache and samples the first token from the prefill's logits. A decode step then feeds every
running sequence's last token at once.

The batch cache. All rows share one write column `pos` (the model's KVCache keeps one position for
the whole batch); a sequence of L cached tokens occupies columns [pos - L, pos) of its row, so rows
that joined at different times are left-padded against each other. Each row's attention mask hides
the columns before its start and its position ids count its own tokens, so a row attends to and
rotates exactly what it would alone: a greedy reply in a batch equals the reply alone (the sums of
a batched matmul may differ in the last bits, which a near-tie between two tokens could expose;
none is known to have in the tests). The buffers are 2 * max_seq_len columns wide and
the model sees the window [off, pos) with off the earliest start of a running row; when pos reaches
the end the window is moved back to column 0 (one copy every max_seq_len steps or so), and a prompt
longer than pos moves it right. Running rows are kept in slots 0..B-1 (a finished row's slot is
filled by moving the later rows down), so a step computes B rows, not the whole capacity.

Sampling (serve/sampling.py): temperature 0 is greedy argmax; otherwise a generator per choice (seeded
with seed + choice index when the request gives a seed), so a seeded reply does not depend on what
else is running.
Text is decoded incrementally: a delta is sent once no stop string can still begin in it and no
multi-byte character is cut; a stop string ends the reply before it (finish_reason "stop"), as do
the stop token ids (not part of the text); max_tokens or the model's context ends it with "length".
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lmforge.errors import LmforgeError
from lmforge.models.common.attention import KVCache, cache_shapes
from lmforge.models.common.rope import refuse_stale_cache
from lmforge.serve.grammar import GrammarError, Matcher, mask_logits_
from lmforge.serve.logprobs import TokenLogprob, chosen_logprobs, prompt_logprobs
from lmforge.serve.prefix_cache import BLOCK_TOKENS, PrefixCache, skips_head, unsupported
from lmforge.serve.sampling import SamplingParams, adjust_, choice_generator, sample, token_counts


class EngineBusy(LmforgeError):
    """The queue of waiting sequences is full; the request was not accepted (try again later)."""


@dataclass(frozen=True)
class Event:
    """What the engine reports for one choice: new text, and how it ended once it has.

    index: prompt_index * n + choice (OpenAI's order). tokens: generated so far by this choice.
    finish_reason: None while running, then "stop" or "length". error: set (index -1) when the
    request failed in the engine; no further events follow. logprobs: the generated tokens whose text
    this event carries (a token held back with its text comes with the event that releases it);
    prompt_logprobs: the prompt's, on the first event of a choice (both only when asked)."""

    index: int
    text: str
    tokens: int
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


class _Request:
    """One submitted request: its prompts, parameters, listener, and the choices still to admit."""

    def __init__(self, prompts: list[list[int]], params: SamplingParams, on_event: Callable[[Event], None]):
        self.prompts, self.params, self.on_event = prompts, params, on_event
        self.pending = deque((p * params.n + j, p) for p in range(len(prompts)) for j in range(params.n))
        self.prefills: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]] = {}
        self.prompt_lps: dict[int, tuple[TokenLogprob, ...]] = {}  # prompt -> its logprobs (if asked)
        self.cancelled = False
        self.failed = False
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None

    def bias(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The logit bias as (token ids, values) tensors, made once per request."""
        if self._bias is None:
            ids, vals = zip(*self.params.logit_bias)
            self._bias = (torch.tensor(ids, device=device), torch.tensor(vals, device=device))
        return self._bias

    def cancel(self) -> None:
        """Stop generating for this request (its sequences leave the batch before the next step)."""
        self.cancelled = True


@dataclass
class _Seq:
    """One running choice in the batch: row `slot` of the cache holds its tokens at [start, pos)."""

    req: _Request
    index: int
    prompt_len: int
    start: int
    max_tokens: int
    generator: torch.Generator | None
    last: int = -1  # the token the next decode step feeds
    n: int = 0  # tokens generated (stop token included)
    text_ids: list[int] = field(default_factory=list)  # generated tokens that are text
    sent: int = 0  # characters of the decoded text already reported
    finished: bool = False
    lp_pending: list[TokenLogprob] = field(default_factory=list)  # recorded, not yet reported
    prompt_lp: tuple[TokenLogprob, ...] | None = None  # reported with the choice's first event
    matcher: Matcher | None = None  # where a constrained choice stands in its grammar
    counts: torch.Tensor | None = None  # (V,) times each token was generated, with penalties only


class _Window:
    """The KVCache interface the Transformer uses, over rows 0..B-1 and columns [off, end) of the
    engine's buffers: views, so the model's writes land in them."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], rows: int, off: int, pos: int) -> None:
        self.k = [t[:rows, :, off:] for t in k]  # each (B, Hkv, W - off, D)
        self.v = [t[:rows, :, off:] for t in v]
        self.batch_size, self.max_len, self.pos = rows, k[0].shape[2] - off, pos - off

    def layer(self, i: int):
        return self.k[i], self.v[i], self.pos


class Engine:
    """Continuous-batching generation over `model` (an lmforge Transformer) in a background thread.

    decode: token ids -> text (the tokenizer's decode). max_batch_size: sequences decoded together.
    max_queue: sequences that may wait for a slot; more is EngineBusy. prefix_cache_bytes: the budget
    of the prefix cache (serve/prefix_cache.py; 0: none), blocks of prefix_block_tokens tokens. Call
    `start()` (or use it as a context manager) before submitting, `close()` to stop the thread.
    """

    def __init__(self, model: nn.Module, decode: Callable[[list[int]], str], *, max_batch_size: int = 8,
                 max_queue: int = 1024, prefix_cache_bytes: int = 0,
                 prefix_block_tokens: int = BLOCK_TOKENS, adapters: Any = None) -> None:
        if max_batch_size < 1:
            raise LmforgeError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model.eval()
        self.decode = decode
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self.adapters = adapters  # serve/adapters.py's AdapterSet, or None: the model alone
        cfg = model.cfg
        self.max_len, self.vocab_size = cfg.max_seq_len, cfg.vocab_size
        param = next(model.parameters())
        self.device = param.device
        dtype = param.dtype if param.is_floating_point() else torch.float32
        self.width = 2 * self.max_len
        k_shape, v_shape = cache_shapes(cfg, max_batch_size, self.width)
        self.k = [torch.zeros(k_shape, device=self.device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(v_shape, device=self.device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.dtype = dtype
        self.rows: list[_Seq] = []  # row i lives in slot i
        self.off = self.pos = 0
        self.steps = 0  # decode steps run (for tests and stats)
        self.peak_batch = 0  # the most rows decoded together so far
        self._waiting: deque[_Request] = deque()
        self._queued = 0  # sequences in _waiting not yet admitted
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.prefix_cache: PrefixCache | None = None
        why_not = unsupported(cfg) if prefix_cache_bytes else None
        if why_not:
            print(f"lmforge serve: prefix cache off: {why_not}", file=sys.stderr)
        elif prefix_cache_bytes:
            self.prefix_cache = PrefixCache(prefix_cache_bytes, prefix_block_tokens)
            self._skip_head = skips_head(model)

    # -- the public side -------------------------------------------------------------------------
    def start(self) -> Engine:
        """Start the engine thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lmforge-engine", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the thread after the current step; requests still running get no further events."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               on_event: Callable[[Event], None]) -> _Request:
        """Queue `prompts` (token ids each) for generation; `on_event` is called from the engine thread
        with each Event (keep it short: hand the event to your own thread or loop). Returns a handle
        whose `cancel()` stops the request."""
        prompts = [list(map(int, p)) for p in prompts]
        self._check(prompts, params)
        req = _Request(prompts, params, on_event)
        with self._cond:
            if self._closing:
                raise LmforgeError("the engine is shut down")
            size = len(prompts) * params.n
            if self._queued + size > self.max_queue:
                raise EngineBusy(f"{self._queued} sequences are already waiting "
                                 f"(max_queue={self.max_queue}); try again later")
            self._waiting.append(req)
            self._queued += size
            self._cond.notify()
        return req

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 timeout: float | None = None) -> list[tuple[str, int, str]]:
        """Blocking convenience: (text, tokens generated, finish_reason) of every choice, in index order."""
        k = len(prompts) * params.n
        texts, tokens, reasons = [""] * k, [0] * k, [""] * k
        done = threading.Event()
        left = [k]
        errors: list[str] = []

        def on_event(ev: Event) -> None:
            if ev.error is not None:
                errors.append(ev.error)
                done.set()
                return
            texts[ev.index] += ev.text
            tokens[ev.index] = ev.tokens
            if ev.finish_reason is not None:
                reasons[ev.index] = ev.finish_reason
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        handle = self.submit(prompts, params, on_event)
        if not done.wait(timeout):
            handle.cancel()
            raise TimeoutError(f"generation did not finish within {timeout} s")
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]}")
        return list(zip(texts, tokens, reasons))

    def _check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if not prompts:
            raise LmforgeError("give at least one prompt")
        for p in prompts:
            if not p:
                raise LmforgeError("every prompt needs at least one token")
            if len(p) >= self.max_len:
                raise LmforgeError(f"a prompt of {len(p)} tokens leaves no room to reply within the model's "
                                   f"context of {self.max_len} tokens")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise LmforgeError(f"prompt token ids must lie in [0, {self.vocab_size}), got "
                                   f"{min(p)}..{max(p)}")
        # Rows share forwards, and a longrope forward switches every row to the long factors past the
        # original length: a row on either side would get other maths than alone. Only wholly short rows.
        longest = max(len(p) for p in prompts) + params.max_tokens
        refuse_stale_cache(self.model.cfg.rope_scaling, 1, longest, "the serving engine")
        if params.max_tokens < 0 or params.n < 1:  # max_tokens 0: the prompt alone (its logprobs)
            raise LmforgeError(f"max_tokens must be >= 0 and n >= 1, got {params.max_tokens} and {params.n}")
        bad_k = params.top_k is not None and params.top_k < 1
        if params.temperature < 0 or not 0 < params.top_p <= 1 or bad_k:
            raise LmforgeError("temperature must be >= 0, top_p in (0, 1] and top_k >= 1 (or None)")
        if any(not 0 <= t < self.vocab_size for t, _ in params.logit_bias):
            raise LmforgeError(f"logit_bias token ids must lie in [0, {self.vocab_size})")

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self.rows and not self._waiting:
                    self._cond.wait()
                if self._closing:
                    return
            self.step()

    @torch.inference_mode()
    def step(self) -> bool:
        """One round of the engine: drop cancelled requests, admit waiting choices into free slots,
        decode one token for every running row. The engine thread calls it in a loop; a caller that
        never `start()`s the engine may drive it by hand. Returns whether work remains."""
        self._drop_cancelled()
        self._admit()
        self.peak_batch = max(self.peak_batch, len(self.rows))
        if self.rows:
            try:
                self._decode()
            except Exception:  # a bug or an out-of-memory: fail the running requests, keep serving
                self._fail({r.req for r in self.rows}, traceback.format_exc())
                self.rows, self.off, self.pos = [], 0, 0
        return bool(self.rows or self._waiting)

    def _fail(self, requests, trace: str) -> None:
        print(f"lmforge serve: generation failed:\n{trace}", file=sys.stderr)
        for req in requests:
            if not req.failed:
                req.failed = True
                req.on_event(Event(-1, "", 0, error=trace.strip().splitlines()[-1]))

    def _drop_cancelled(self) -> None:
        if any(r.req.cancelled or r.req.failed for r in self.rows):
            self._remove([r for r in self.rows if r.req.cancelled or r.req.failed])
        with self._cond:
            while self._waiting and self._waiting[0].cancelled:
                self._queued -= len(self._waiting.popleft().pending)

    def _admit(self) -> None:
        """Move waiting choices into free slots, oldest request first."""
        while len(self.rows) < self.max_batch_size:
            with self._cond:
                if not self._waiting:
                    return
                req = self._waiting[0]
                if req.cancelled:
                    self._queued -= len(self._waiting.popleft().pending)
                    continue
                index, p = req.pending.popleft()
                self._queued -= 1
                if not req.pending:
                    self._waiting.popleft()
            try:
                self._start(req, index, p)
            except Exception:
                self._fail([req], traceback.format_exc())
                self._remove([r for r in self.rows if r.req is req])
                with self._cond:
                    if req.pending and req in self._waiting:
                        self._waiting.remove(req)
                        self._queued -= len(req.pending)

    def _start(self, req: _Request, index: int, p: int) -> None:
        """Prefill prompt p (once per prompt), place choice `index` in the next slot and sample its
        first token."""
        if p not in req.prefills:
            req.prefills[p] = self._prefill(req, p)
        ks, vs, logits = req.prefills[p]
        prompt_lp = req.prompt_lps.get(p)
        if not any(q == p for _, q in req.pending):
            del req.prefills[p]  # the last choice of this prompt
            req.prompt_lps.pop(p, None)
        L = len(req.prompts[p])
        if req.params.max_tokens == 0:  # only the prompt scored: no slot, no token
            req.on_event(Event(index, "", 0, "length", logprobs=(), prompt_logprobs=prompt_lp))
            return
        if not self.rows:
            self.off = self.pos = 0
        if self.pos < L:  # make room on the left: move the window right
            self._move(self.off + L - self.pos)
        slot, start = len(self.rows), self.pos - L
        for buf, src in zip(self.k, ks):
            buf[slot, :, start : self.pos] = src[0]
        for buf, src in zip(self.v, vs):
            buf[slot, :, start : self.pos] = src[0]
        self.off = min(self.off, start) if self.rows else start
        params = req.params
        gen = choice_generator(params, index, self.device)
        seq = _Seq(req, index, L, start, min(params.max_tokens, self.max_len - L), gen, prompt_lp=prompt_lp,
                   matcher=params.grammar.matcher() if params.grammar is not None else None)
        self.rows.append(seq)
        self._emit(seq, self._next_tokens([seq], logits)[0])
        if seq.finished:
            self._remove([seq])

    def _prefill(self, req: _Request, p: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Prompt p of `req` alone through the model: its keys and values (one (1, H, L, D) tensor
        per layer each) and the logits (1, V) of its last position."""
        # Prompt logprobs (echo) need every position's logits; the cached prefill keeps only the last.
        if self.prefix_cache is not None and req.params.prompt_logprobs is None:
            cache = KVCache(self.model, 1, len(req.prompts[p]), device=self.device, dtype=self.dtype)
            forward = lambda ids, c, **kw: self._forward([req], ids, cache=c, **kw)  # noqa: E731
            logits = self.prefix_cache.prefill(req.prompts[p], forward, cache, self._cache_namespace(req),
                                               self._skip_head)
            return cache.k, cache.v, logits
        ids = torch.tensor([req.prompts[p]], dtype=torch.long, device=self.device)  # (1, L)
        cache = KVCache(self.model, 1, ids.shape[1], device=self.device, dtype=self.dtype)
        logits = self._forward([req], ids, cache=cache)  # (1, L, V)
        if req.params.prompt_logprobs is not None:
            req.prompt_lps[p] = prompt_logprobs(logits[0, :-1], req.prompts[p], req.params.prompt_logprobs)
        return cache.k, cache.v, logits[:, -1]

    def _cache_namespace(self, req: _Request) -> bytes:
        """What besides its tokens a request's keys/values depend on (e.g. an adapter, with its version):
        the prefix cache shares blocks only between requests with the same namespace."""
        a = req.params.adapter
        return b"" if a is None else f"{a.name}\0{a.serial}".encode()

    def _forward(self, reqs: list[_Request], ids: torch.Tensor, **kw) -> torch.Tensor:
        """The model on `ids` (B, T), row i for request reqs[i]: every forward of the engine goes
        through here (the one place that knows what a row needs beyond its tokens)."""
        if self.adapters is None:
            return self.model(ids, **kw)
        with self.adapters.batch([r.params.adapter for r in reqs]):  # each row with its own adapter
            return self.model(ids, **kw)

    def _move(self, new_off: int) -> None:
        """Move the window's columns [off, pos) of the running rows to start at column new_off."""
        shift, B = new_off - self.off, len(self.rows)
        if shift == 0:
            return
        if B:
            for buf in (*self.k, *self.v):
                buf[:B, :, new_off : self.pos + shift] = buf[:B, :, self.off : self.pos].clone()
        for r in self.rows:
            r.start += shift
        self.off, self.pos = new_off, self.pos + shift

    def _decode(self) -> None:
        """One token for every running row."""
        if self.pos == self.width:
            self._move(0)
        B, S = len(self.rows), self.pos - self.off
        ids = torch.tensor([[r.last] for r in self.rows], dtype=torch.long, device=self.device)  # (B, 1)
        starts = torch.tensor([r.start - self.off for r in self.rows], device=self.device)  # (B,)
        mask = (torch.arange(S + 1, device=self.device)[None] >= starts[:, None]).long()  # (B, S + 1)
        positions = (S - starts)[:, None]  # (B, 1): each row's own token count
        view = _Window(self.k, self.v, B, self.off, self.pos)
        logits = self._forward([r.req for r in self.rows], ids, cache=view, attention_mask=mask,
                               position_ids=positions)[:, -1]  # (B, V)
        self.pos += 1
        self.steps += 1
        for r, tok in zip(self.rows, self._next_tokens(self.rows, logits)):
            self._emit(r, tok)
        if any(r.finished for r in self.rows):
            self._remove([r for r in self.rows if r.finished])

    def _next_tokens(self, rows: list[_Seq], logits: torch.Tensor) -> list[int]:
        """The next token of each row from the step's logits (B, V): what a row may emit is decided
        here, then sampled; what the reply reports about the choice is recorded with the token."""
        # Logprobs are the raw model's (as vLLM and OpenAI report them): kept before a grammar masks.
        constrained = any(r.matcher is not None for r in rows)
        asking = any(r.req.params.logprobs is not None for r in rows)
        adjusted = any(r.req.params.adjusts() for r in rows)
        raw = logits.clone() if (constrained or adjusted) and asking else logits
        if adjusted:
            self._adjust(rows, logits)
        if constrained:
            self._constrain(rows, logits)
        tokens = sample(logits, [r.req.params for r in rows], [r.generator for r in rows])
        for r, tok in zip(rows, tokens) if adjusted else ():
            if r.counts is not None:
                r.counts[tok] += 1
        for r, tok in zip(rows, tokens):
            if r.matcher is not None and not r.req.failed and tok not in r.req.params.stop_ids:
                try:
                    r.matcher.accept(tok)
                except GrammarError as e:
                    self._fail([r.req], f"GrammarError: {e}")
        self._record_logprobs(rows, raw, tokens)
        return tokens

    def _adjust(self, rows: list[_Seq], logits: torch.Tensor) -> None:
        """Add the rows' logit biases and subtract their presence / frequency penalties, in place."""
        for i, r in enumerate(rows):
            p = r.req.params
            if p.penalises() and r.counts is None:  # what it generated before (its first token, at admission)
                r.counts = token_counts(r.text_ids, logits.shape[-1], logits.device)
            adjust_(logits[i], p, r.req.bias(logits.device) if p.logit_bias else None, r.counts)

    def _constrain(self, rows: list[_Seq], logits: torch.Tensor) -> None:
        """Mask, in place, the logits of the rows under a grammar to the tokens it allows; the other
        rows' logits are not touched (no grammar in the batch: nothing happens). A grammar that fails
        fails its own request only."""
        idx = [i for i, r in enumerate(rows) if r.matcher is not None]
        if idx:
            failed = mask_logits_(logits, idx, [rows[i].matcher for i in idx],
                                  [rows[i].req.params.stop_ids for i in idx])
            for j, why in failed.items():
                self._fail([rows[idx[j]].req], f"GrammarError: {why}")

    def _record_logprobs(self, rows: list[_Seq], logits: torch.Tensor, tokens: list[int]) -> None:
        """Keep the chosen tokens' log-probabilities for the rows whose request asks (only those rows'
        logits are normalised: a request that does not ask costs nothing)."""
        asking = [i for i, r in enumerate(rows) if r.req.params.logprobs is not None]
        if not asking:
            return
        ks = [rows[i].req.params.logprobs for i in asking]
        records = chosen_logprobs(logits[asking], [tokens[i] for i in asking], ks)
        for i, rec in zip(asking, records):
            rows[i].lp_pending.append(rec)

    def _emit(self, r: _Seq, tok: int) -> None:
        """Account token `tok` to row r: report the text that is now certain, and whether r ended."""
        if r.req.failed:  # its error event was the last one
            r.finished = True
            return
        r.n += 1
        p = r.req.params
        reason = None
        if tok in p.stop_ids:
            reason = "stop"
        else:
            r.text_ids.append(tok)
            r.last = tok
        text = self.decode(r.text_ids)
        end = len(text)
        hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
        if hits:
            end, reason = min(hits), "stop"
        elif reason is None and r.matcher is not None and r.matcher.done():
            reason = "stop"
        elif reason is None and r.n >= r.max_tokens:
            reason = "length"
        if reason is None:  # hold back what a stop string or an unfinished character may still change
            end -= _held_back(text, p.stop)
        if end > r.sent or reason is not None:
            delta, r.sent = text[r.sent : max(end, r.sent)], max(end, r.sent)
            if reason is not None:
                r.finished = True
            lps = prompt_lps = None
            if p.logprobs is not None:
                lps, r.lp_pending = tuple(r.lp_pending), []
            if r.prompt_lp is not None:
                prompt_lps, r.prompt_lp = r.prompt_lp, None
            r.req.on_event(Event(r.index, delta, r.n, reason, logprobs=lps, prompt_logprobs=prompt_lps))

    def _remove(self, gone: list[_Seq]) -> None:
        """Drop rows, moving the later rows down so that the running ones fill slots 0..B-1."""
        gone_ids = {id(r) for r in gone}
        keep = [r for r in self.rows if id(r) not in gone_ids]
        old = {id(r): i for i, r in enumerate(self.rows)}
        for new, r in enumerate(keep):
            src = old[id(r)]
            if src != new:
                for buf in (*self.k, *self.v):
                    buf[new, :, self.off : self.pos] = buf[src, :, self.off : self.pos]
        self.rows = keep
        if keep:
            self.off = min(r.start for r in keep)
        else:
            self.off = self.pos = 0


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` not to report yet: an unfinished UTF-8 character (decoded as
    U+FFFD) or the beginning of a stop string."""
    hold = len(text) - len(text.rstrip("\ufffd"))
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold
