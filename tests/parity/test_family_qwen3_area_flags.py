"""The block flags Qwen3, Granite and SmolLM3 need, each on its own against a reference built from the
same weights: per-head q/k norm, the attention output bias, the Granite multipliers, NoPE layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import ModelConfig
from lmforge.models import Transformer
from lmforge.models.flops import count_params

V, T = 64, 9
BASE = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, d_ff=40,
            max_seq_len=32, tie_embeddings=False)


def model(**over) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelConfig(**{**BASE, **over})).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights large enough for attention to be far from uniform; norms around 1
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
    return m


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def copy_into(dst: Transformer, src: Transformer) -> Transformer:
    dst.load_state_dict(src.state_dict())
    return dst


def test_per_head_qk_norm_normalises_each_head_on_its_own():
    # A tiny eps: RMSNorm is then invariant to the scale of its input.
    m = model(qk_norm=True, qk_norm_scope="head", norm_eps=1e-12)
    attn = m.layers[0].attn
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (12,)
    assert count_params(m.cfg) == sum(p.numel() for p in m.parameters())
    x = ids()
    with torch.no_grad():
        ref = m(x)
        # RMSNorm per head: scaling one head's q rows (and one kv head's k rows) changes nothing ...
        attn.wq.weight[12:24] *= 3.0
        attn.wk.weight[:12] *= 0.25
        torch.testing.assert_close(m(x), ref, atol=1e-5, rtol=0)
        # ... while the whole-projection norm sees the other heads shrink.
        whole = model(qk_norm=True, norm_eps=1e-12)
        before = whole(x)
        whole.layers[0].attn.wq.weight[12:24] *= 3.0
        assert (whole(x) - before).abs().amax() > 1e-3


def test_per_head_and_whole_projection_agree_with_one_head():
    one = dict(n_heads=1, n_kv_heads=1, head_dim=16)
    head, whole = model(qk_norm=True, qk_norm_scope="head", **one), model(qk_norm=True, **one)
    copy_into(whole, head)
    with torch.no_grad():
        torch.testing.assert_close(whole(ids()), head(ids()), atol=1e-6, rtol=0)


def test_qk_norm_scope_without_qk_norm_is_refused():
    with pytest.raises(ValueError, match="qk_norm_scope=head .*qk_norm=false"):
        ModelConfig(**BASE, qk_norm_scope="head")


def test_attn_out_bias_adds_a_bias_to_wo_only():
    m = model(qkv_bias=True, attn_out_bias=True)
    assert m.layers[1].attn.wo.bias is not None and m.layers[1].mlp.w_down.bias is None
    assert count_params(m.cfg) == sum(p.numel() for p in m.parameters())
    with torch.no_grad():
        ref = m(ids())
        for layer in m.layers:
            layer.attn.wo.bias.zero_()
        assert (m(ids()) - ref).abs().amax() > 1e-3


def test_embedding_multiplier_scales_the_embeddings():
    m = model(embedding_multiplier=3.5)
    ref = copy_into(model(), m)
    with torch.no_grad():
        ref.tok_embeddings.weight.mul_(3.5)
        torch.testing.assert_close(m(ids()), ref(ids()), atol=1e-5, rtol=0)


def test_attention_multiplier_is_the_softmax_scale():
    # No q/k norm or bias: scaling q's weights by c scales the scores by c, as a scale of c/sqrt(D) does.
    m = model(attention_multiplier=0.7)
    ref = copy_into(model(), m)
    with torch.no_grad():
        for layer in ref.layers:
            layer.attn.wq.weight.mul_(0.7 * 12**0.5)
        torch.testing.assert_close(m(ids()), ref(ids()), atol=1e-5, rtol=0)
        default = copy_into(model(attention_multiplier=12**-0.5), m)
        torch.testing.assert_close(default(ids()), copy_into(model(), m)(ids()), atol=1e-6, rtol=0)


def reference_forward(m: Transformer, x: torch.Tensor) -> torch.Tensor:
    """The decoder written out with every area flag applied by hand."""
    cfg = m.cfg
    h = m.tok_embeddings(x) * cfg.embedding_multiplier
    rope = (m.rope_cos[:T], m.rope_sin[:T])
    for i, layer in enumerate(m.layers):
        layer_rope = None if i in cfg.nope_layers else rope
        h = h + cfg.residual_multiplier * layer.attn(layer.attn_norm(h), layer_rope)
        h = h + cfg.residual_multiplier * layer.mlp(layer.mlp_norm(h))
    return m.output(m.norm(h)) / cfg.logits_scaling


@pytest.mark.parametrize("over", [dict(residual_multiplier=0.3), dict(logits_scaling=4.0),
                                  dict(nope_layers=[0]), dict(nope_layers=[1], residual_multiplier=1.7),
                                  dict(embedding_multiplier=2.0, residual_multiplier=0.5,
                                       logits_scaling=3.0)],
                         ids=str)
def test_residual_logits_and_nope_flags_match_the_written_out_forward(over):
    m = model(**over)
    plain = copy_into(model(), m)
    with torch.no_grad():
        got = m(ids())
        torch.testing.assert_close(got, reference_forward(m, ids()), atol=1e-5, rtol=0)
        assert (got - plain(ids())).abs().amax() > 1e-3  # the flag does change the model


def test_logits_scaling_reaches_the_head_path_but_not_the_hidden_states():
    m = model(logits_scaling=5.0)
    plain = copy_into(model(), m)
    with torch.no_grad():
        logits = m(ids())
        torch.testing.assert_close(m(ids(), head=lambda h, w: F.linear(h, w)), logits, atol=1e-6, rtol=0)
        # A head that reads the hidden states (a reward model's score) sees them unscaled.
        torch.testing.assert_close(m(ids(), head=lambda h, w: h), plain(ids(), head=lambda h, w: h))


def test_nope_layers_without_rope_anywhere_ignore_positions():
    m = model(nope_layers=[0, 1])
    shifted = torch.arange(0, 2 * T, 2).expand(2, T)  # spread out: RoPE sees a relative change
    with torch.no_grad():
        torch.testing.assert_close(m(ids(), position_ids=shifted), m(ids()), atol=1e-6, rtol=0)
        half = copy_into(model(nope_layers=[1]), m)
        assert (half(ids(), position_ids=shifted) - half(ids())).abs().amax() > 1e-3


@pytest.mark.parametrize("over,needle", [
    (dict(nope_layers=[2]), "nope_layers has \\[2\\]"), (dict(nope_layers=[0, 0]), "lists a layer twice"),
    (dict(nope_layers=[0], pos_embedding="learned"), "pos_embedding=learned"),
    (dict(attention_multiplier=0.0), "attention_multiplier"), (dict(logits_scaling=-1.0), "logits_scaling"),
])
def test_impossible_flag_values_are_refused(over, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig(**{**BASE, **over})
