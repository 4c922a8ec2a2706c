"""Prefix caching for the serving engine: the keys/values of prompt blocks that earlier requests
computed (a shared system prompt, few-shot examples, the earlier turns of a chat) are kept and copied
into a later prompt's prefill instead of being recomputed.

Blocks. A prompt is cut into blocks of `block_tokens` tokens; block i is named by a digest of every
token up to the end of block i (chained: the digest of block i-1 and block i's tokens), as vLLM's
automatic prefix caching does, so equal digests mean equal whole prefixes and a block is only ever
reused after the very same tokens. A block holds, per layer, the (heads, block_tokens, dim) slices of
the prefill cache (for MLA models the compressed latent and rotated key part: whatever the model's
KVCache holds along its position axis).

Exactness. With the cache on, every prompt is prefilled in block-aligned chunks, hit or miss: chunk
[i*B, (i+1)*B) runs on top of the keys/values of the chunks before it. A hit replaces the first chunks
by copies of what an earlier miss computed in exactly that way, so the keys/values and logits of a
prompt are the same bits whether its prefix was cached or not (tests/unit/test_serve_prefix_cache.py).
They may differ in the last bits from the cache-off path, which runs the prompt in one forward (other
matmul shapes), as a batched decode step already may (engine.py): measured, the tiny test models' short
prompts mostly gave the same logits and the bench's 1k-token prompts none, differing by at most 2.5e-6
(bench/serve_prefix.py); the replies, greedy and seeded, were the same in every test and in the bench.
A prompt of at most one block is one forward, as without the cache (the same bits). At least the
prompt's last token is always computed, so its logits exist even when the whole prompt is cached.

Memory. The cache holds at most `budget_bytes` of keys/values; past it, the least recently used
blocks are evicted. A prompt's blocks are touched deepest first, so a block is always older than its
ancestors and eviction takes the ends of chains before their beginnings (a block whose parent is gone
could never be matched again). The blocks a running prefill matched or stored are pinned until it
ends, and a block that does not fit ends the storing of that prompt, for the same reason.

Models whose keys/values depend on more than the tokens before them get no cache (`unsupported`):
RoPE scaling that rotates every key by the length of the forward (dynamic NTK, longrope) and MoE with
a token capacity (which token an expert drops depends on the whole forward). Sliding-window layers
are fine: the cache keeps every position and the mask applies the window.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lmforge.models.common.attention import KVCache

# Tokens per block, which is also the prefill's chunk. Measured (bench/serve_prefix.py, 1 thread, 2 shared
# cores, a 4-layer d_model-256 model; three runs, noisy): a 1024-token miss in chunks of 16 / 32 / 64 / 128
# took 1.5-2.9 / 1.1-1.8 / 0.8-1.1 / 0.75-1.0x the one-pass prefill (whose head projects every position);
# small chunks lose to per-forward overhead and narrow matmuls. 64 keeps a miss about as fast as without
# the cache while a hit still reuses all but at most 64 tokens of the shared prefix.
BLOCK_TOKENS = 64


@dataclass(eq=False)
class _Block:
    k: list[torch.Tensor]  # per layer (H, block_tokens, D)
    v: list[torch.Tensor]
    nbytes: int
    pins: int = 0


@dataclass
class PrefixStats:
    """Counters since the server started: prompts prefilled, their tokens, the tokens taken from the
    cache, blocks stored and evicted, and the bytes held now."""

    prompts: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    stored: int = 0
    evicted: int = 0
    bytes: int = 0
    budget: int = 0
    blocks: int = 0
    block_tokens: int = 0

    def as_dict(self) -> dict:
        rate = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"prompts": self.prompts, "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens,
                "hit_rate": round(rate, 4), "blocks": self.blocks, "block_tokens": self.block_tokens,
                "stored": self.stored, "evicted": self.evicted, "bytes": self.bytes,
                "budget_bytes": self.budget}


def unsupported(cfg) -> str | None:
    """Why the keys/values of a prompt's block would depend on how the prefill is cut (so reusing
    them would change outputs) for this ModelConfig, or None where block reuse is exact."""
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.type in ("dynamic", "longrope"):
        return (f"model.rope_scaling.type={scaling.type} rotates every key of a forward by that forward's "
                "length, so a block's keys depend on the prompt around it")
    if cfg.moe is not None and cfg.moe.capacity_factor is not None:
        return ("model.moe.capacity_factor drops tokens by how many the whole forward sends to an expert, "
                "so a block's keys depend on the prompt around it")
    return None


def skips_head(model) -> bool:
    """Whether the chunks before a prompt's last may run `model` without its output projection (a
    `head=` that returns nothing): where the head is a plain weight and no soft-cap refuses `head=`.
    On the test machine the projection of every prompt position was most of a chunked prefill's
    extra cost (bench/serve_prefix.py)."""
    cfg = model.cfg
    if cfg.final_logit_softcap is not None:
        return False
    out = model.tok_embeddings if cfg.tie_embeddings else getattr(model, "output", None)
    return isinstance(getattr(out, "weight", None), torch.Tensor)


def _no_logits(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    return None


class PrefixCache:
    """Keys/values of prompt blocks under an LRU byte budget, used by `Engine._prefill` (one thread)."""

    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if budget_bytes < 1 or block_tokens < 1:
            raise ValueError(f"a prefix cache needs budget_bytes >= 1 and block_tokens >= 1, got "
                             f"{budget_bytes} and {block_tokens}")
        self.budget, self.block = budget_bytes, block_tokens
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self.stats = PrefixStats(budget=budget_bytes, block_tokens=block_tokens)

    def keys(self, tokens: Sequence[int], namespace: bytes = b"") -> list[bytes]:
        """The digest of every whole block of `tokens`: block i's names tokens[: (i + 1) * block]
        (and the namespace: whatever else the keys/values depend on, e.g. an adapter)."""
        out, prev = [], hashlib.blake2b(namespace, digest_size=16).digest()
        for s in range(0, len(tokens) - self.block + 1, self.block):
            block = array("q", tokens[s : s + self.block]).tobytes()
            prev = hashlib.blake2b(prev + block, digest_size=16).digest()
            out.append(prev)
        return out

    def prefill(self, tokens: Sequence[int], forward: Callable[..., torch.Tensor], cache: KVCache,
                namespace: bytes = b"", skip_head: bool = False) -> torch.Tensor:
        """Fill `cache` (a fresh KVCache of batch 1 and at least len(tokens) positions) with the
        prompt's keys/values: cached blocks copied, the rest computed chunk by chunk through
        `forward(ids (1, T), cache, **kw) -> logits (1, T, V)` and stored. Returns the logits (1, V)
        of the prompt's last position. skip_head (see `skips_head`): the chunks before the last are
        run with kw head= a projection that computes nothing (their logits are never read)."""
        L = len(tokens)
        keys = self.keys(tokens, namespace)
        hit: list[_Block] = []
        for key in keys[: (L - 1) // self.block]:  # the last token is always computed: its logits
            b = self._blocks.get(key)
            if b is None:
                break
            hit.append(b)
        held = list(hit)  # pinned until the prefill ends: its hits, then the blocks it stores
        for b in held:
            b.pins += 1
        try:
            n = len(hit) * self.block
            if hit:
                for layer, buf in enumerate(cache.k):
                    buf[0, :, :n] = torch.cat([b.k[layer] for b in hit], dim=1)
                for layer, buf in enumerate(cache.v):
                    buf[0, :, :n] = torch.cat([b.v[layer] for b in hit], dim=1)
            cache.pos = n
            ids = torch.tensor([list(tokens)], dtype=torch.long, device=cache.k[0].device)  # (1, L)
            logits, storing = None, True
            for s in range(n, L, self.block):
                kw = {"head": _no_logits} if skip_head and s + self.block < L else {}
                logits = forward(ids[:, s : s + self.block], cache, **kw)
                cache.pos = min(s + self.block, L)  # a forward with head= returns before advancing it
                if storing and s + self.block <= L:
                    # A block that does not fit ends the storing: its descendants could never be matched.
                    b = self._store(keys[s // self.block], cache, s)
                    storing = b is not None
                    if b is not None:
                        b.pins += 1
                        held.append(b)
        finally:
            for b in held:
                b.pins -= 1
        for key in reversed(keys):  # deepest first: ancestors stay younger than their descendants
            if key in self._blocks:
                self._blocks.move_to_end(key)
        st = self.stats
        st.prompts, st.prompt_tokens, st.hit_tokens = st.prompts + 1, st.prompt_tokens + L, st.hit_tokens + n
        return logits[:, -1]

    def _store(self, key: bytes, cache: KVCache, s: int) -> _Block | None:
        """Keep the block at positions [s, s + block) of `cache` under `key` (the one already held,
        if any), or None where the budget cannot make room."""
        if key in self._blocks:
            return self._blocks[key]
        k = [buf[0, :, s : s + self.block].clone() for buf in cache.k]
        v = [buf[0, :, s : s + self.block].clone() for buf in cache.v]
        nbytes = sum(t.numel() * t.element_size() for t in (*k, *v))
        if not self._make_room(nbytes):
            return None
        b = self._blocks[key] = _Block(k, v, nbytes)
        self.stats.stored += 1
        self.stats.bytes += nbytes
        self.stats.blocks = len(self._blocks)
        return b

    def _make_room(self, nbytes: int) -> bool:
        """Evict unpinned blocks, least recently used first, until `nbytes` more fit the budget."""
        if nbytes > self.budget:
            return False
        st = self.stats
        while st.bytes + nbytes > self.budget:
            # Pinned blocks (the running prefill's hits, at most a prompt's worth) are skipped.
            key = next((k for k, b in self._blocks.items() if b.pins == 0), None)
            if key is None:
                break
            st.bytes -= self._blocks.pop(key).nbytes
            st.evicted += 1
        st.blocks = len(self._blocks)
        return st.bytes + nbytes <= self.budget

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks
