"""RoPE scaling (linear, dynamic NTK, llama3) against transformers' own functions and models.

Frequencies and cos/sin tables must be bit-identical to transformers' in float32; logits of a tiny
LlamaForCausalLM with each scaling type must match ours to 1e-5 (dynamic: on a sequence longer than
the original context, and through a KV cache across that boundary).
"""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig, RopeScalingConfig
from lmforge.models import KVCache, Transformer
from lmforge.models.common.rope import dynamic_inv_frequencies, inv_frequencies, rope_tables

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

V, D_MODEL, HEADS, ORIG, ATOL = 96, 64, 4, 16, 1e-5  # head_dim 16: wavelengths 6 .. 18000
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,  # wavelengths 6 | 20 | 63.. straddle 32/4 and 32/1
    },
}


def hf_config(kind: str) -> transformers.LlamaConfig:
    # transformers' dynamic NTK is relative to max_position_embeddings; the others to the long context.
    return transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=D_MODEL,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        max_position_embeddings=ORIG if kind == "dynamic" else 64,
        rope_theta=10000.0,
        rope_scaling=dict(SCALINGS[kind]),
        tie_word_embeddings=False,
    )


def our_config(kind: str) -> ModelConfig:
    s = SCALINGS[kind]
    scaling = RopeScalingConfig(
        type=kind,
        factor=s["factor"],
        original_max_position_embeddings=s.get("original_max_position_embeddings", ORIG)
        if kind != "linear" else None,
        low_freq_factor=s.get("low_freq_factor", 1.0),
        high_freq_factor=s.get("high_freq_factor", 4.0),
    )
    return ModelConfig(
        vocab_size=V, d_model=D_MODEL, d_ff=96, n_layers=2, n_heads=HEADS, n_kv_heads=2, max_seq_len=64,
        norm_eps=1e-6, tie_embeddings=False, rope_scaling=scaling,
    )


def hf_llama(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config(kind)).float().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)
    return model


def ours_from(hf: torch.nn.Module, kind: str) -> Transformer:
    """Our model with hf's weights (the key map is the plain Llama one; see models/hf/llama.py)."""
    from lmforge.models.hf.llama import KEYS

    ours = Transformer(our_config(kind))
    ours.load_state_dict({KEYS.to_ours(k): v for k, v in hf.state_dict().items()}, strict=True)
    return ours.eval()


@pytest.mark.parametrize("kind", ["linear", "llama3"])
def test_static_inv_freq_and_tables_bit_identical(kind):
    cfg = hf_config(kind)
    ref, scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    assert scale == 1.0
    ours = our_config(kind)
    got = inv_frequencies(16, 10000.0, ours.rope_scaling, ours.rope_scaling.original_max_position_embeddings)
    assert torch.equal(got, ref)
    # cos/sin of our model's buffers against transformers' rotary embedding, every position.
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    pos = torch.arange(64)[None]
    cos_ref, sin_ref = rotary(torch.zeros(1, dtype=torch.float32), pos)
    model = Transformer(ours)
    assert torch.equal(model.rope_cos, cos_ref[0]) and torch.equal(model.rope_sin, sin_ref[0])
    # The scaling really changes the tables.
    plain_cos, _ = rope_tables(16, 64, 10000.0)
    assert not torch.equal(model.rope_cos, plain_cos)


def test_llama3_touches_all_three_frequency_bands():
    scaling = our_config("llama3").rope_scaling
    plain = inv_frequencies(16, 10000.0)
    scaled = inv_frequencies(16, 10000.0, scaling, scaling.original_max_position_embeddings)
    ratio = plain / scaled
    assert ratio[0] == 1.0  # high frequencies unchanged
    assert ratio[-1] == pytest.approx(8.0)  # low frequencies divided by factor
    assert ((ratio > 1.0) & (ratio < 8.0 - 1e-4)).any()  # smoothed band in between


def test_dynamic_inv_freq_bit_identical_at_init_and_growth():
    cfg = hf_config("dynamic")
    fn = ROPE_INIT_FUNCTIONS["dynamic"]
    at_init, _ = fn(cfg, "cpu")
    assert torch.equal(inv_frequencies(16, 10000.0, our_config("dynamic").rope_scaling, ORIG), at_init)
    for seq_len in (ORIG, ORIG + 1, 40, 64):
        # transformers passes max(position_ids) + 1 as a 0-d int64 tensor at run time.
        ref, _ = fn(cfg, "cpu", seq_len=torch.tensor(seq_len))
        assert torch.equal(dynamic_inv_frequencies(16, 10000.0, 2.0, ORIG, seq_len), ref)
    assert not torch.equal(dynamic_inv_frequencies(16, 10000.0, 2.0, ORIG, 40), at_init)


@pytest.mark.parametrize("kind", ["linear", "dynamic", "llama3"])
def test_logits_parity_with_rope_scaling(kind):
    hf = hf_llama(kind)
    ours = ours_from(hf, kind)
    x = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))  # 40 > ORIG
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        got = ours(x)
    assert ref.abs().amax() > 0.5
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    # The scaling matters for this input: plain RoPE gives other logits.
    plain = Transformer(our_config(kind).model_copy(update={"rope_scaling": None}))
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (plain.eval()(x) - ref).abs().amax() > 1e-3


def test_dynamic_short_sequence_equals_plain_rope():
    hf = hf_llama("dynamic")
    ours = ours_from(hf, "dynamic")
    plain = Transformer(our_config("dynamic").model_copy(update={"rope_scaling": None}))
    plain.load_state_dict(ours.state_dict())
    x = torch.randint(0, V, (1, ORIG), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ours(x), plain.eval()(x))
        torch.testing.assert_close(ours(x), hf(input_ids=x).logits, atol=ATOL, rtol=0)


def test_dynamic_kv_cache_across_the_original_length_matches_hf():
    """Step-by-step decoding past ORIG: transformers regrows the base each step and keeps old keys as
    cached; our stateless rule (base from this forward's largest position) does the same."""
    hf = hf_llama("dynamic")
    ours = ours_from(hf, "dynamic")
    prompt = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(3))
    steps = 30  # ends at position 39 > ORIG
    with torch.no_grad():
        hf.generation_config.eos_token_id = None  # never stop early
        hf.generation_config.pad_token_id = 0
        mask = torch.ones_like(prompt)
        ref = hf.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=steps)
        cache = KVCache(ours, 1, 10 + steps)
        logits = ours(prompt, cache=cache)
        out = []
        for _ in range(steps):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            logits = ours(nxt, cache=cache)
    assert torch.equal(torch.cat(out, dim=1), ref[:, 10:])
