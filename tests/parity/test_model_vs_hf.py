"""Logits parity with transformers' Llama, Qwen2, Mistral and GPT-2 on tiny random models (float32, 1e-5).

Each test builds a small random HF model from a config (no download), copies its weights into ours
through a key map written here (the production adapters live in lmforge.models.hf later), and
compares logits.
"""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmforge.config import ModelConfig  # noqa: E402
from lmforge.models import Transformer  # noqa: E402

V, T, ATOL = 128, 24, 1e-5

LLAMA_KEYS = {
    r"model\.embed_tokens\.weight": "tok_embeddings.weight",
    r"model\.norm\.weight": "norm.weight",
    r"lm_head\.weight": "output.weight",
    r"model\.layers\.(\d+)\.input_layernorm\.weight": r"layers.\1.attn_norm.weight",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": r"layers.\1.mlp_norm.weight",
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)": r"layers.\1.attn.wq.\2",
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)": r"layers.\1.attn.wk.\2",
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)": r"layers.\1.attn.wv.\2",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": r"layers.\1.attn.wo.weight",
    r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight": r"layers.\1.mlp.w_gate.weight",
    r"model\.layers\.(\d+)\.mlp\.up_proj\.weight": r"layers.\1.mlp.w_up.weight",
    r"model\.layers\.(\d+)\.mlp\.down_proj\.weight": r"layers.\1.mlp.w_down.weight",
}


def randomize(hf: torch.nn.Module, seed: int = 0) -> None:
    """Random weights and biases everywhere (HF inits biases to 0 and norms to 1, which would hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_norm = re.search(r"norm|ln_", name) and name.endswith("weight")
            p.copy_(1.0 + 0.1 * noise if is_norm else 0.08 * noise)


def convert_llama_like(hf_sd: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    out = {}
    for key, w in hf_sd.items():
        if tied and key == "lm_head.weight":
            continue
        for pattern, target in LLAMA_KEYS.items():
            if re.fullmatch(pattern, key):
                out[re.sub(pattern, target, key)] = w
                break
        else:
            raise KeyError(f"unmapped HF key {key}")
    return out


def convert_gpt2(hf_sd: dict[str, torch.Tensor], d: int) -> dict[str, torch.Tensor]:
    out = {}
    simple = {"wte": "tok_embeddings", "wpe": "pos_embeddings", "ln_f": "norm"}
    per_layer = {
        "ln_1": "attn_norm",
        "ln_2": "mlp_norm",
        "attn.c_proj": "attn.wo",
        "mlp.c_fc": "mlp.w_up",
        "mlp.c_proj": "mlp.w_down",
    }
    for key, w in hf_sd.items():
        if key == "lm_head.weight" or key.endswith(".attn.bias") or key.endswith(".attn.masked_bias"):
            continue  # tied head; causal-mask buffers of older versions
        m = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)", key)
        if m is None:
            name, kind = re.fullmatch(r"transformer\.(\w+)\.(weight|bias)", key).groups()
            out[f"{simple[name]}.{kind}"] = w
            continue
        i, name, kind = m.groups()
        # Conv1D stores (in, out): our nn.Linear wants (out, in).
        w = w.t() if kind == "weight" and not name.startswith("ln_") else w
        if name == "attn.c_attn":  # fused q|k|v along the output dimension
            for part, chunk in zip(("wq", "wk", "wv"), w.split(d, dim=0)):
                out[f"layers.{i}.attn.{part}.{kind}"] = chunk
        else:
            out[f"layers.{i}.{per_layer[name]}.{kind}"] = w
    return out


def compare(hf: torch.nn.Module, ours: Transformer, sd: dict[str, torch.Tensor]) -> torch.Tensor:
    missing, unexpected = ours.load_state_dict(sd, strict=True)
    assert not missing and not unexpected
    x = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.eval()(input_ids=x).logits
        got = ours.eval()(x)
    assert ref.abs().amax() > 0.5  # logits big enough for 1e-5 to be a real check
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    return ref


def hf_model(cls, config, impl: str = "eager") -> torch.nn.Module:
    config._attn_implementation = impl
    torch.manual_seed(0)
    model = cls(config).float()
    randomize(model)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_llama_parity(tied):
    hf_cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
    )
    hf = hf_model(transformers.LlamaForCausalLM, hf_cfg)
    ours = Transformer(
        ModelConfig(
            vocab_size=V,
            d_model=48,
            d_ff=80,
            n_layers=2,
            n_heads=6,
            n_kv_heads=3,
            max_seq_len=64,
            norm_eps=1e-5,
            tie_embeddings=tied,
        )
    )
    compare(hf, ours, convert_llama_like(hf.state_dict(), tied))


def test_qwen2_parity():
    hf_cfg = transformers.Qwen2Config(
        vocab_size=V,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )
    hf = hf_model(transformers.Qwen2ForCausalLM, hf_cfg)
    ours = Transformer(
        ModelConfig(
            vocab_size=V,
            d_model=48,
            d_ff=96,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            max_seq_len=64,
            norm_eps=1e-6,
            rope_theta=1e6,
            qkv_bias=True,
            tie_embeddings=False,
        )
    )
    sd = convert_llama_like(hf.state_dict(), tied=False)
    assert "layers.0.attn.wq.bias" in sd
    compare(hf, ours, sd)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_mistral_sliding_window_parity(impl):
    window = 5  # smaller than T = 24, so the window really cuts attention
    hf_cfg = transformers.MistralConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        sliding_window=window,
        tie_word_embeddings=False,
    )
    hf = hf_model(transformers.MistralForCausalLM, hf_cfg, impl)
    c = dict(
        vocab_size=V,
        d_model=32,
        d_ff=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=64,
        tie_embeddings=False,
    )
    sd = convert_llama_like(hf.state_dict(), tied=False)
    ref = compare(hf, Transformer(ModelConfig(**c, sliding_window=window)), sd)
    # The window must matter: without it the logits past position `window` differ.
    no_window = Transformer(ModelConfig(**c))
    no_window.load_state_dict(sd)
    x = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (no_window.eval()(x) - ref)[:, window:].abs().amax() > 1e-3


def test_gpt2_parity():
    hf_cfg = transformers.GPT2Config(
        vocab_size=V,
        n_embd=48,
        n_layer=2,
        n_head=4,
        n_positions=64,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf = hf_model(transformers.GPT2LMHeadModel, hf_cfg)
    ours = Transformer(
        ModelConfig(
            vocab_size=V,
            d_model=48,
            n_layers=2,
            n_heads=4,
            max_seq_len=64,
            norm="layernorm",
            bias=True,
            pos_embedding="learned",
            mlp="gelu_tanh",
            norm_eps=1e-5,
            tie_embeddings=True,
        )
    )
    compare(hf, ours, convert_gpt2(hf.state_dict(), d=48))
