"""Every RoPE scaling kind against transformers 5, past the original context: the cos/sin tables of
our model equal those of transformers' rotary embedding (bit for bit), a tiny Llama with the scaling
imports with equal float32 logits at T > original and exports to a config transformers reads back
with equal logits, dynamic NTK generates as transformers' generate does while the sequence grows
past the original length, and what lmforge cannot express is refused by name."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models import KVCache, Transformer
from lmforge.models.common.rope import apply_rope, rope_tables
from lmforge.models.generation import sample_replies
from lmforge.models.hf import from_hf, hf_to_model_config, to_hf

transformers = pytest.importorskip("transformers")

V, ATOL, NEW = 96, 1e-5, 16
ORIGINAL, MAX_POS, THETA = 32, 128, 500.0  # a small theta puts some frequencies inside yarn's ramp
SHAPE = dict(vocab_size=V, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
_long = [1.0 + 0.5 * i for i in range(8)]  # head_dim 16: 8 frequencies
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},  # original = max_position_embeddings (32)
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    # Qwen-style: factor and original only (attention factor 0.1 ln(4) + 1).
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    # DeepSeek-V3 style: the attention factor as a ratio of mscales.
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                    "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.6},
    # gpt-oss style: other betas, an untruncated correction range.
    "yarn_untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                         "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.8,
                              "original_max_position_embeddings": ORIGINAL},
    # Phi-3 style: short factors up to the original length, long ones past it; factor from the lengths.
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                 "short_factor": [1.0 + 0.05 * i for i in range(8)], "long_factor": _long},
    "longrope_factor": {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL, "factor": 2.0,
                        "short_factor": [1.0] * 8, "long_factor": _long, "attention_factor": 1.3},
}


def hf_config(kind: str):
    params = {**SCALINGS[kind], "rope_theta": THETA}
    max_pos = ORIGINAL if params["rope_type"] == "dynamic" else MAX_POS
    return transformers.LlamaConfig(**SHAPE, max_position_embeddings=max_pos, rope_parameters=params)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)


class HFLog:
    """Collects transformers' warnings (its logger does not propagate to the root logger)."""

    def __enter__(self):
        self.messages: list[str] = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.messages.append(record.getMessage())
        logging.getLogger("transformers").addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        logging.getLogger("transformers").removeHandler(self.handler)


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def scaled(request, tmp_path_factory):
    """(kind, HF Llama with that scaling, our import of its save_pretrained dir)."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config(request.param)).float().eval()
    randomize(hf)
    hf.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path, from_hf(path).eval()


def test_tables_equal_transformers_past_the_original_length(scaled):
    kind, hf, _, ours = scaled
    for length in (ORIGINAL, ours.cfg.max_seq_len):  # at the original length and well past it
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf.config)  # fresh state
        pos = torch.arange(length)[None]
        cos_ref, sin_ref = rotary(torch.zeros(1, dtype=torch.float32), pos)
        cos, sin = ours._rope(0, length, None, length)
        assert torch.equal(cos, cos_ref[0]) and torch.equal(sin, sin_ref[0]), (kind, length)


def test_import_gives_equal_logits_past_the_original_length(scaled):
    kind, hf, _, ours = scaled
    ids = torch.randint(3, V, (2, 80), generator=torch.Generator().manual_seed(1))  # 80 > 32
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=ATOL)
        short = ids[:, :20]  # within the original length (longrope: the short factors)
        torch.testing.assert_close(ours(short), hf(short).logits, rtol=0, atol=ATOL)


def test_export_is_read_back_by_transformers_with_equal_logits(scaled, tmp_path):
    kind, hf, _, ours = scaled
    to_hf(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == SCALINGS[kind]["rope_type"]
    with HFLog() as log:  # no "unrecognized keys" or factor complaints
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    assert not log.messages, log.messages
    ids = torch.randint(3, V, (1, 100), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, rtol=0, atol=0)
    assert from_hf(tmp_path).cfg == ours.cfg


@pytest.mark.parametrize("kind", ["dynamic", "yarn"])
def test_greedy_generation_across_the_original_length_equals_transformers(kind, tmp_path):
    """Dynamic NTK: transformers recomputes the base at every step as the sequence grows; keys already
    cached keep their rotation. 24 prompt tokens + 16 new ones cross the original 32."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config(kind)).float().eval()
    randomize(hf, seed=3)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path).eval()
    prompt = torch.randint(3, V, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf.generate(prompt, do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0,
                          return_dict_in_generate=True, output_logits=True)
    got = sample_replies(ours, [prompt[0].tolist()], NEW, frozenset(), temperature=0.0)
    assert got[0] == ref.sequences[0, 24:].tolist()
    # Each step's logits, through our KV cache, against transformers' (random models often repeat tokens).
    seq, cache = ref.sequences, KVCache(ours, 1, 24 + NEW)
    with torch.no_grad():
        steps = [ours(prompt, cache=cache)[:, -1]]
        steps += [ours(seq[:, 24 + k - 1 : 24 + k], cache=cache)[:, -1] for k in range(1, NEW)]
    torch.testing.assert_close(torch.cat(steps), torch.cat(ref.logits), rtol=0, atol=ATOL)


def test_partial_rotary_rotates_the_first_dims_only():
    head_dim, rot = 12, 8
    x = torch.randn(2, 5, 3, head_dim)
    cos, sin = rope_tables(rot, 5, 10000.0)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[..., rot:], x[..., rot:])
    assert torch.equal(out[..., :rot], apply_rope(x[..., :rot].contiguous(), cos, sin))
    assert not torch.equal(out[..., :rot], x[..., :rot])


def test_rotary_fraction_is_validated():
    with pytest.raises(ValueError, match="even, nonzero count"):
        ModelConfig(d_model=40, n_heads=4, rotary_fraction=0.3)  # int(10 * 0.3) = 3 dims: odd
    cfg = ModelConfig(d_model=64, n_heads=4, rotary_fraction=0.25)
    assert cfg.rotary_dim == 4
    model = Transformer(cfg.model_copy(update={"vocab_size": 16, "n_layers": 1}))
    assert model.rope_cos.shape == (cfg.max_seq_len, 4)


def _llama(**change) -> dict:
    return {**transformers.LlamaConfig(**SHAPE, max_position_embeddings=MAX_POS).to_dict(), **change}


@pytest.mark.parametrize("change, match", [
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "rope_type.*proportional"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "warp": 3}}, "unknown key.*warp"),
    ({"rope_scaling": {"type": "longrope", "original_max_position_embeddings": 32, "short_factor": [1.0] * 8,
                       "long_factor": [1.0] * 5}}, "long_factor must list one factor per rotary frequency"),
    ({"rope_scaling": {"type": "longrope", "original_max_position_embeddings": 32, "short_factor": "x",
                       "long_factor": [1.0] * 8}}, "short_factor must be a list of numbers"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
])
def test_what_cannot_be_expressed_is_refused_by_name(change, match):
    with pytest.raises(LmforgeError, match=match):
        hf_to_model_config(_llama(**change))


def test_old_style_rope_scaling_keys_are_read():
    """transformers 4.x: top-level rope_theta and rope_scaling with `type`."""
    old = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, "beta_fast": None,
           "mscale": 0}
    hf = _llama(rope_theta=321.0, rope_scaling=old)
    hf.pop("rope_parameters")
    sc = hf_to_model_config(hf).rope_scaling
    # transformers reads `beta_fast or 32` and `if mscale and mscale_all_dim`: the same here
    assert (sc.type, sc.factor, sc.original_max_position_embeddings, sc.beta_fast) == ("yarn", 2.0, 16, 32.0)
    assert hf_to_model_config(hf).rope_theta == 321.0
