"""The serving engine's prefix cache (serve/prefix_cache.py): a prompt's keys/values and logits are
the same bits whether its blocks came from the cache or were computed (cold vs warm), and replies,
greedy and seeded, are the same with the cache off, on-cold and on-warm: prompts sharing no, some or
all blocks, block-aligned prompts, n > 1, concurrent requests, a tiny budget that evicts; sliding-
window and MLA models; models whose keys depend on the whole forward get no cache."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.config.schema import QuantConfig
from lmforge.models import Transformer
from lmforge.models.common.attention import KVCache
from lmforge.models.transformer import build_model
from lmforge.serve.engine import Engine, SamplingParams
from lmforge.serve.prefix_cache import PrefixCache, skips_head, unsupported

V, B = 61, 8  # vocabulary, block tokens


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                tie_embeddings=False, init_std=0.1)
    return Transformer(ModelConfig(**{**base, **kw})).eval()


def text(ids) -> str:
    return "".join(chr(0x100 + t) for t in ids)


def prompts() -> list[list[int]]:
    """A shared 2-block prefix, then: a tail, another tail, the prefix alone (block-aligned), one
    block more (aligned), a prompt sharing only the first block, one sharing nothing, a short one."""
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(2 * B)
    return [shared + ids(3), shared + ids(5), shared, shared + ids(B), shared[:B] + ids(B + 2),
            ids(2 * B + 1), ids(3)]


def replies(engine: Engine, ps, params: SamplingParams, together: bool = False) -> list[list[str]]:
    """Each prompt's choices, one request after another (or all submitted before the first step)."""
    out: list[list[str]] = []
    results = []
    for p in ps:
        got: dict[int, str] = {}
        results.append(got)
        engine.submit([p], params, lambda ev, g=got: g.update({ev.index: g.get(ev.index, "") + ev.text}))
        if not together:
            while engine.step():
                pass
    while engine.step():
        pass
    for got in results:
        out.append([got[i] for i in range(params.n)])
    return out


def engine(model, mb: float | None = 1.0, **kw) -> Engine:
    size = 0 if mb is None else int(mb * 2**20)
    return Engine(model, text, prefix_cache_bytes=size, prefix_block_tokens=B, **kw)


GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=7, n=2)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 12}, {"final_logit_softcap": 3.0},
                                {"n_kv_heads": None, "mla": {"kv_lora_rank": 16, "qk_nope_head_dim": 8,
                                                             "qk_rope_head_dim": 8, "v_head_dim": 8}}],
                         ids=["gqa", "sliding", "softcap", "mla"])
def test_replies_equal_off_cold_warm(params, kw):
    model = tiny(**kw)
    ps = prompts()
    off = replies(engine(model, None), ps, params)
    on = engine(model)
    cold = replies(on, ps, params)
    hits_cold = on.prefix_cache.stats.hit_tokens
    warm = replies(on, ps, params)
    assert cold == off and warm == off
    # Cold: the 2nd, 4th and 5th prompts reuse the shared blocks the 1st stored (the 3rd, exactly two
    # blocks, recomputes its last block for its logits). Warm: every prompt reuses what it can.
    assert hits_cold == 2 * B + B + 2 * B + B
    assert on.prefix_cache.stats.hit_tokens - hits_cold == 2 * B + 2 * B + B + 2 * B + 2 * B + 2 * B


def test_prefill_bits_equal_cold_and_warm():
    """The keys/values and last logits of a prompt are identical bits with its prefix computed or
    copied, for prompts whose cached part ends at every block boundary."""
    model = tiny(d_model=64, n_heads=8, n_kv_heads=2)
    ps = prompts()
    cache = PrefixCache(1 << 20, B)

    def prefill(p, skip_head):
        kv = KVCache(model, 1, len(p))
        with torch.inference_mode():
            logits = cache.prefill(p, lambda ids, c, **kw: model(ids, cache=c, **kw), kv, skip_head=skip_head)
        return logits, kv

    cold = [prefill(p, False) for p in ps]
    hit_before = cache.stats.hit_tokens
    warm = [prefill(p, True) for p in ps]  # the projection skipped before the last chunk: same bits
    assert cache.stats.hit_tokens > hit_before
    for (l1, c1), (l2, c2) in zip(cold, warm):
        assert torch.equal(l1, l2)
        assert all(torch.equal(a, b) for a, b in zip(c1.k + c1.v, c2.k + c2.v))


def test_head_is_skipped_only_where_it_is_a_plain_weight():
    assert skips_head(tiny()) and skips_head(tiny(tie_embeddings=True))
    assert not skips_head(tiny(final_logit_softcap=30.0))  # head= is refused with a soft-cap
    cfg = tiny().cfg.model_copy(update={"quant": QuantConfig(bits=8, head=True, group_size=None)})
    assert skips_head(build_model(cfg))  # a quantized head reads as its dequantized weight
    wrapped = tiny()
    wrapped.output = torch.nn.Sequential(wrapped.output)  # a head with no weight of its own
    assert not skips_head(wrapped)


def test_block_aligned_prompt_still_computes_its_last_token():
    model = tiny()
    p = prompts()[2]  # exactly 2 blocks
    cache = PrefixCache(1 << 20, B)
    for _ in range(2):
        kv = KVCache(model, 1, len(p))
        with torch.inference_mode():
            logits = cache.prefill(p, lambda ids, c: model(ids, cache=c), kv)
        assert logits.shape == (1, V) and kv.pos == len(p)
    assert cache.stats.hit_tokens == B and len(cache) == 2


def test_tiny_budget_evicts_ends_of_chains_first_and_replies_stay_equal():
    model = tiny()
    block_bytes = 2 * 2 * (2 * B * 8) * 4  # layers x (k, v) x (heads x tokens x dim) x fp32
    ps = prompts()
    off = replies(engine(model, None), ps, SAMPLED)
    on = engine(model, 2 * block_bytes / 2**20)
    assert replies(on, ps, SAMPLED) == off and replies(on, ps, SAMPLED) == off
    st = on.prefix_cache.stats
    assert st.evicted > 0 and len(on.prefix_cache) <= 2 and st.bytes <= 2 * block_bytes
    # Whatever is held can still be matched: a block is never kept without its parent.
    cache = on.prefix_cache
    for key in list(cache._blocks):
        chains = [cache.keys(p) for p in ps]
        chain = next(c for c in chains if key in c)
        assert all(k in cache for k in chain[: chain.index(key)])
    # A budget below one block stores nothing and changes nothing.
    none = engine(model, (block_bytes - 1) / 2**20)
    assert replies(none, ps, GREEDY) == replies(engine(model, None), ps, GREEDY)
    assert len(none.prefix_cache) == 0 and none.prefix_cache.stats.stored == 0


def test_blocks_of_the_running_prefill_are_not_evicted():
    model = tiny()
    block_bytes = 2 * 2 * (2 * B * 8) * 4
    cache = PrefixCache(2 * block_bytes, B)
    p = prompts()[0]  # 2 blocks + 3 tokens: stores 2 blocks, the budget is full
    longer = p[: 2 * B] + list(range(2 * B))  # hits both, then needs room for 2 more

    def prefill(q):
        with torch.inference_mode():
            return cache.prefill(q, lambda ids, c: model(ids, cache=c), KVCache(model, 1, len(q)))

    prefill(p)
    keys = cache.keys(p)
    prefill(longer)
    assert all(k in cache for k in keys) and len(cache) == 2 and cache.stats.evicted == 0
    assert cache.stats.hit_tokens == 2 * B


def test_concurrent_requests_sharing_a_prefix():
    model = tiny()
    ps = prompts()[:4]
    off = replies(engine(model, None, max_batch_size=4), ps, SAMPLED, together=True)
    on = engine(model, max_batch_size=4)
    assert replies(on, ps, SAMPLED, together=True) == off
    assert on.prefix_cache.stats.hit_tokens == 2 * B + B + 2 * B


def test_namespaces_do_not_share_blocks():
    cache = PrefixCache(1 << 20, B)
    p = prompts()[0]
    assert cache.keys(p, b"adapter-a") != cache.keys(p, b"adapter-b")
    assert cache.keys(p)[:2] == cache.keys(p[: 2 * B])


@pytest.mark.parametrize("kw, word", [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 32}}, "dynamic"),
    ({"moe": {"n_experts": 4, "top_k": 2, "capacity_factor": 1.0}}, "capacity_factor"),
])
def test_models_whose_keys_depend_on_the_whole_forward_get_no_cache(kw, word, capsys):
    model = tiny(**kw)
    assert word in unsupported(model.cfg)
    e = engine(model)
    assert e.prefix_cache is None
    err = capsys.readouterr().err
    assert "prefix cache off" in err and word in err
    assert unsupported(tiny(sliding_window=12).cfg) is None


def test_bad_budget_refused():
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixCache(0)


def test_a_prompt_longer_than_the_budget_keeps_its_first_blocks():
    """Under a budget of 2 blocks a 4-block prompt stores its first 2 (not its last 2, which could
    never be matched without their parents), and the same prompt then reuses them."""
    model = tiny()
    block_bytes = 2 * 2 * (2 * B * 8) * 4
    cache = PrefixCache(2 * block_bytes, B)
    p = list(range(4 * B + 1))
    keys = cache.keys(p)
    for _ in range(2):
        with torch.inference_mode():
            cache.prefill(p, lambda ids, c: model(ids, cache=c), KVCache(model, 1, len(p)))
    assert keys[0] in cache and keys[1] in cache and len(cache) == 2
    assert cache.stats.hit_tokens == 2 * B and cache.stats.evicted == 0


def test_the_cli_flag_reaches_serve(monkeypatch):
    import lmforge.serve
    from lmforge.cli import main

    got = {}
    monkeypatch.setattr(lmforge.serve, "serve", lambda path, **kw: got.update(kw))
    assert main(["serve", "runs/x", "--no-auth", "--prefix-cache-mb", "0"]) == 0
    assert got["prefix_cache_mb"] == 0
    assert main(["serve", "runs/x", "--no-auth"]) == 0
    assert got["prefix_cache_mb"] == lmforge.serve.PREFIX_CACHE_MB == 256
