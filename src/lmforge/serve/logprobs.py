"""Log-probabilities for `lmforge serve`: computed in the engine from the model's raw logits, shaped
here into OpenAI's two forms.

What is reported: log_softmax of the model's logits in float32, before temperature, top-k and top-p
(the raw model's distribution, as OpenAI and vLLM report it by default), for the chosen token and the
`k` most likely ones. Every generated token is reported, one entry per token of
usage.completion_tokens, as vLLM does: a stop token (EOS, end of turn) too, though its text is not in
the reply (OpenAI's chat shows no end-of-turn token, but a harness that scores with `echo` and
`max_tokens: 1` drops the last entry as the generated one, whatever it was), and tokens whose text a
stop string cuts. Prompt tokens (completions `echo`) have the log-probability of each token given those before
it; the first has none (null), as in OpenAI and vLLM.

- /v1/completions, `logprobs: k` (0..5): {"tokens", "token_logprobs", "top_logprobs" (a {token:
  logprob} dict per token: the k best, plus the chosen token when it is not among them, as vLLM),
  "text_offset" (the character where each token starts in the choice's text)}.
- /v1/chat/completions, `logprobs: true, top_logprobs: k` (0..20): {"content": [{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"}] (the k best)}]}.

A token's text is its bytes decoded as UTF-8; a token that is part of a character (byte-level BPE
splits some) is written "bytes:\\xe2\\x80" as OpenAI writes it; `bytes` always holds the exact bytes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions' `logprobs`
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's `top_logprobs`
_CHUNK = 256  # prompt positions per log_softmax: (chunk, V) float32 at a time, not (L, V)
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(frozen=True)
class TokenLogprob:
    """One reported token: its id, its log-probability (None: the first prompt token, which nothing
    predicts) and the most likely tokens at its position as (id, log-probability), best first."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def chosen_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """The record of tokens[i] drawn from logits[i] (rows, V), with the ks[i] best alternatives."""
    lp = logits.float().log_softmax(dim=-1)  # (rows, V)
    target = torch.tensor(tokens, device=lp.device)[:, None]
    chosen = lp.gather(1, target)[:, 0].tolist()
    kmax = min(max(ks), lp.shape[-1])
    vals, idx = lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], lp[:, :0].long())
    vals, idx = vals.tolist(), idx.tolist()
    return [TokenLogprob(t, c, tuple(zip(idx[i][: ks[i]], vals[i][: ks[i]])))
            for i, (t, c) in enumerate(zip(tokens, chosen))]


def prompt_logprobs(logits: torch.Tensor, ids: list[int], k: int) -> tuple[TokenLogprob, ...]:
    """The record of every prompt token from the prompt's logits (L, V): position i predicts ids[i + 1]."""
    out = [TokenLogprob(ids[0], None)]
    for s in range(0, len(ids) - 1, _CHUNK):
        e = min(s + _CHUNK, len(ids) - 1)
        out += chosen_logprobs(logits[s:e], ids[s + 1 : e + 1], [k] * (e - s))
    return tuple(out)


class TokenText:
    """Each id's exact bytes and its text as OpenAI writes it (cached; the vocabulary is fixed)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        hf = tokenizer.hf
        self._added = {i: t.content for i, t in hf.get_added_tokens_decoder().items()}
        self._byte_map = _byte_level_map(hf)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        """(text, bytes) of `token`."""
        hit = self._cache.get(token)
        if hit is None:
            hit = self._cache[token] = self._describe(token)
        return hit

    def _describe(self, token: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.hf.id_to_token(token)
        if token in self._added or piece is None:
            raw = self._added.get(token, "").encode("utf-8")
        elif self._byte_map is not None and all(c in self._byte_map for c in piece):
            raw = bytes(self._byte_map[c] for c in piece)
        elif _BYTE_FALLBACK.fullmatch(piece):  # SentencePiece's byte fallback: <0xE2> is one byte
            raw = bytes([int(piece[3:5], 16)])
        else:  # SentencePiece-style: "▁" is a space (decoding one token alone would drop a leading one)
            raw = piece.replace("\u2581", " ").encode("utf-8")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)


def _byte_level_map(hf) -> dict[str, int] | None:
    from lmforge.data.tokenizer import byte_level_decoder_map

    dec = json.loads(hf.to_str()).get("decoder") or {}
    parts = dec.get("decoders", [dec]) if dec.get("type") == "Sequence" else [dec]
    return byte_level_decoder_map() if any(d.get("type") == "ByteLevel" for d in parts) else None


class Shaper:
    """The logprobs of one request's choices in OpenAI's shape, one event's share at a time.

    chat: the chat form, else the completions form. k: alternatives per token (None: no logprobs).
    echo: the prompt text of each prompt (completions with `echo`), put before the first text of each
    of its n choices."""

    def __init__(self, text: TokenText, *, chat: bool, k: int | None, n: int = 1,
                 echo: list[str] | None = None) -> None:
        self.text, self.chat, self.k, self.n, self.echo = text, chat, k, n, echo
        self._offset: dict[int, int] = {}  # choice -> characters of its text so far

    def event(self, index: int, text: str, records, prompt_records) -> tuple[str, dict | None]:
        """(the text to send, its logprobs piece) for one event of choice `index`: the prompt text
        comes first when echoing and this is the choice's first event."""
        first = index not in self._offset
        if first and self.echo is not None:
            text = self.echo[index // self.n] + text
        entries = (tuple(prompt_records or ()) if first else ()) + tuple(records or ())
        offset = self._offset.get(index, 0)
        self._offset[index] = offset + len(text)
        if self.k is None:
            return text, None
        if self.chat:
            return text, {"content": [self._chat_entry(r) for r in entries]}
        tokens, lps, tops, offsets = [], [], [], []
        for r in entries:
            word, raw = self.text(r.token)
            tokens.append(word)
            lps.append(r.logprob)
            if r.logprob is None:
                tops.append(None)
            else:
                top = {self.text(t)[0]: v for t, v in r.top}
                top.setdefault(word, r.logprob)
                tops.append(top)
            offsets.append(offset)
            offset += sum(1 for b in raw if b & 0xC0 != 0x80)  # characters the token begins
        return text, {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_entry(self, r: TokenLogprob) -> dict:
        word, raw = self.text(r.token)
        top = []
        for t, v in r.top:
            w, b = self.text(t)
            top.append({"token": w, "logprob": v, "bytes": b})
        return {"token": word, "logprob": r.logprob, "bytes": raw, "top_logprobs": top}


def merge(pieces: list[dict]) -> dict:
    """One choice's pieces joined into its whole logprobs object (list fields concatenated)."""
    out: dict = {}
    for piece in pieces:
        for key, value in piece.items():
            out.setdefault(key, []).extend(value)
    return out
