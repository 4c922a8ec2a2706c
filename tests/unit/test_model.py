"""Transformer: shapes per flag, masking, GQA, positions, state_dict keys, init, meta build, KV cache."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.models import KVCache, Transformer, build_model
from lmforge.models.common.norm import RMSNorm

V = 97


def cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
    return ModelConfig(**{**base, **kw})


def model(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg(**kw)).eval()


def ids(B: int = 2, T: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


NORMS, POSITIONS, MLPS = ["rmsnorm", "layernorm"], ["rope", "learned"], ["swiglu", "gelu", "gelu_tanh"]
FLAGS = list(itertools.product(NORMS, POSITIONS, MLPS, [False, True]))


@pytest.mark.parametrize("norm,pos,mlp,bias", FLAGS)
def test_shapes_and_backward_for_flag_combinations(norm, pos, mlp, bias):
    m = model(norm=norm, pos_embedding=pos, mlp=mlp, bias=bias, n_kv_heads=2).train()
    logits = m(ids())
    assert logits.shape == (2, 12, V) and logits.dtype == torch.float32
    logits.float().logsumexp(-1).mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize(
    "kw",
    [
        dict(qkv_bias=True),
        dict(tie_embeddings=False),
        dict(sliding_window=4),
        dict(dropout=0.1),
        dict(head_dim=16, n_kv_heads=1),
        dict(d_ff=40, mlp="gelu"),
    ],
)
def test_shapes_other_flags(kw):
    m = model(**kw)
    assert m(ids()).shape == (2, 12, V)


def test_missing_vocab_size_is_a_clear_error():
    with pytest.raises(ValueError, match="model.vocab_size"):
        Transformer(ModelConfig())


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_too_long_input_is_an_error(pos):
    with pytest.raises(ValueError, match="max_seq_len"):
        model(pos_embedding=pos)(ids(T=33))


@pytest.mark.parametrize("kw", [dict(), dict(pos_embedding="learned", norm="layernorm", mlp="gelu_tanh")])
def test_causal_future_tokens_do_not_change_earlier_logits(kw):
    m = model(**kw)
    x = ids(T=16)
    y = x.clone()
    y[:, 9] = (y[:, 9] + 1) % V
    a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :9], b[:, :9], atol=1e-6, rtol=0)
    assert (a[:, 9:] - b[:, 9:]).abs().amax() > 1e-3


@pytest.mark.parametrize("window", [1, 3, 5])
def test_sliding_window_semantics(window):
    # One layer: logits at i depend on token j iff i - window < j <= i (Mistral's convention).
    m = model(n_layers=1, sliding_window=window)
    x = ids(B=1, T=16)
    j = 6
    y = x.clone()
    y[:, j] = (y[:, j] + 1) % V
    changed = ((m(x) - m(y)).abs().amax(-1) > 1e-6)[0]
    expected = torch.tensor([j <= i < j + window for i in range(16)])
    assert torch.equal(changed, expected)


def test_window_wider_than_sequence_equals_plain_causal():
    torch.testing.assert_close(model(sliding_window=12)(ids()), model()(ids()), atol=1e-6, rtol=0)


@pytest.mark.parametrize("n_kv", [1, 2])
def test_gqa_equals_mha_with_repeated_kv_heads(n_kv):
    # Query head h reads kv head h // (n_heads / n_kv_heads), the grouping HF's repeat_kv uses.
    gqa = model(n_kv_heads=n_kv)
    mha = model(n_kv_heads=None)
    assert gqa.layers[0].attn.wk.weight.shape == (n_kv * 8, 32)
    sd = gqa.state_dict()
    for k, w in sd.items():
        if k.endswith(("attn.wk.weight", "attn.wv.weight")):
            sd[k] = w.view(n_kv, 8, 32).repeat_interleave(4 // n_kv, dim=0).reshape(32, 32)
    mha.load_state_dict(sd)
    torch.testing.assert_close(gqa(ids()), mha(ids()), atol=1e-5, rtol=0)


def test_learned_vs_rope_parameters_and_no_rope_in_state_dict():
    rope, learned = model().state_dict(), model(pos_embedding="learned").state_dict()
    assert "pos_embeddings.weight" not in rope and learned["pos_embeddings.weight"].shape == (32, 32)
    assert not any("rope" in k for k in rope)
    assert set(learned) - set(rope) == {"pos_embeddings.weight"}


def test_tied_vs_untied_state_dict_keys():
    tied, untied = model(tie_embeddings=True), model(tie_embeddings=False)
    assert "output.weight" not in tied.state_dict() and not hasattr(tied, "output")
    assert set(untied.state_dict()) - set(tied.state_dict()) == {"output.weight"}
    n = sum(p.numel() for p in tied.parameters())
    assert sum(p.numel() for p in untied.parameters()) == n + V * 32
    # Tied logits really use the embedding table.
    with torch.no_grad():
        tied.tok_embeddings.weight[5] += 1.0
    assert (tied(ids()) - model(tie_embeddings=True)(ids()))[..., 5].abs().amax() > 1e-3


def test_state_dict_names():
    keys = set(model(norm="layernorm", bias=True, tie_embeddings=False).state_dict())
    for k in [
        "tok_embeddings.weight",
        "norm.weight",
        "norm.bias",
        "output.weight",
        "layers.1.attn_norm.weight",
        "layers.1.attn_norm.bias",
        "layers.1.mlp_norm.weight",
        "layers.1.attn.wq.weight",
        "layers.1.attn.wq.bias",
        "layers.1.attn.wk.bias",
        "layers.1.attn.wv.weight",
        "layers.1.attn.wo.weight",
        "layers.1.attn.wo.bias",
        "layers.1.mlp.w_gate.weight",
        "layers.1.mlp.w_up.bias",
        "layers.1.mlp.w_down.weight",
    ]:
        assert k in keys, k
    qwen = set(model(qkv_bias=True, mlp="gelu").state_dict())
    assert "layers.0.attn.wq.bias" in qwen and "layers.0.attn.wo.bias" not in qwen
    assert "layers.0.mlp.w_gate.weight" not in qwen and "layers.0.mlp.w_up.bias" not in qwen
    assert "norm.bias" not in set(model(norm="layernorm").state_dict())


def test_init_statistics():
    m = model(d_model=512, n_heads=8, n_layers=8, norm="layernorm", bias=True, vocab_size=64)
    attn = m.layers[3].attn
    # 262k samples: the relative standard error of a std estimate is ~0.14%; allow 2%.
    assert attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert attn.wo.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.02)
    assert m.layers[3].mlp.w_down.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.02)
    assert m.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert abs(attn.wq.weight.mean().item()) < 2e-4
    assert torch.all(attn.wq.bias == 0) and torch.all(m.layers[0].mlp.w_down.bias == 0)
    assert torch.all(m.norm.weight == 1) and torch.all(m.norm.bias == 0)


def test_init_is_seeded_and_meta_build_matches_direct_build():
    c = cfg(pos_embedding="rope", tie_embeddings=False)
    torch.manual_seed(3)
    direct = Transformer(c)
    torch.manual_seed(3)
    built = build_model(c)
    torch.manual_seed(4)
    other = build_model(c)
    for k, v in direct.state_dict().items():
        assert torch.equal(v, built.state_dict()[k]), k
    assert not torch.equal(direct.layers[0].attn.wq.weight, other.layers[0].attn.wq.weight)
    torch.testing.assert_close(direct.rope_cos, built.rope_cos, atol=0, rtol=0)
    torch.testing.assert_close(direct(ids()), built(ids()), atol=0, rtol=0)


def test_build_on_meta_stays_on_meta_and_loads_a_checkpoint():
    src = model(tie_embeddings=False)
    meta = build_model(cfg(tie_embeddings=False), device="meta")
    assert all(p.is_meta for p in meta.parameters()) and meta.rope_cos.is_meta
    # to_empty + load_state_dict (no init_weights) must still give working RoPE tables.
    meta.to_empty(device="cpu")
    meta.load_state_dict(src.state_dict())
    torch.testing.assert_close(meta.eval()(ids()), src(ids()), atol=0, rtol=0)


def test_rmsnorm_matches_reference_formula():
    torch.manual_seed(0)
    x = torch.randn(4, 7, 64) * 3
    n = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        n.weight.normal_()
    ref = n.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(n(x), ref, atol=1e-6, rtol=0)
    low = n.to(torch.bfloat16)(x.bfloat16())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, atol=0.1, rtol=0.02)


def test_dropout_only_in_training():
    m = model(dropout=0.2)
    torch.testing.assert_close(m(ids()), m(ids()), atol=0, rtol=0)
    m.train()
    assert (m(ids()) - m(ids())).abs().amax() > 1e-4


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(n_kv_heads=1),
        dict(pos_embedding="learned", norm="layernorm", bias=True),
        dict(sliding_window=4),
        dict(qkv_bias=True, tie_embeddings=False),
    ],
)
def test_kv_cache_matches_full_forward(kw):
    m = model(**kw)
    x = ids(T=20)
    full = m(x)
    cache = KVCache(m, batch_size=2, max_len=20)
    # Prefill, then a chunk at a non-zero position (explicit-mask path), then single tokens.
    parts = [m(x[:, :7], cache=cache), m(x[:, 7:11], cache=cache)]
    parts += [m(x[:, t : t + 1], cache=cache) for t in range(11, 20)]
    assert cache.pos == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


def test_kv_cache_overflow_and_batch_mismatch_are_errors():
    m = model()
    cache = KVCache(m, batch_size=2, max_len=8)
    m(ids(T=6), cache=cache)
    with pytest.raises(ValueError, match="KVCache"):
        m(ids(T=3), cache=cache)
    with pytest.raises(ValueError, match="KVCache"):
        m(ids(B=1, T=1), cache=cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        KVCache(m.cfg, batch_size=1, max_len=64)
