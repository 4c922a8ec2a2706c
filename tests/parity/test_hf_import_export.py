"""Hugging Face import / export (lmforge.models.hf) against transformers, on tiny random models that
transformers itself saved: padded logits and greedy generation at float32 1e-5, lossless round trips,
sharding, RoPE scaling, and clear errors for what lmforge cannot reproduce.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.errors import LmforgeError
from lmforge.eval.generate import generate
from lmforge.models import KVCache, Transformer
from lmforge.models.hf import from_hf, hf_to_model_config, load_pretrained, model_config_to_hf, to_hf

transformers = pytest.importorskip("transformers")

V, T, ATOL, NEW = 96, 20, 1e-5, 32
COMMON = dict(vocab_size=V, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    # GQA 6/3 and head_dim 12 != 48/6, untied.
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, head_dim=12, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "llama_tied": lambda: transformers.LlamaConfig(
        **COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, tie_word_embeddings=True,
    ),
    # Window 5 < T: the window cuts attention.
    "mistral": lambda: transformers.MistralConfig(
        **COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=5, tie_word_embeddings=False,
    ),
    # Always-on q/k/v bias, large theta, tied, GQA 6/3, head_dim 16 != 48/6.
    "qwen2": lambda: transformers.Qwen2Config(
        **COMMON, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, head_dim=16, max_position_embeddings=64, rope_theta=1e6,
        tie_word_embeddings=True, use_sliding_window=False,
    ),
    "gpt2": lambda: transformers.GPT2Config(
        **COMMON, n_embd=48, n_layer=2, n_head=4, n_positions=64, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ),
}


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights and biases everywhere (HF inits biases to 0 and norms to 1, which would hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_norm = re.search(r"norm|ln_", name) and name.endswith("weight")
            p.copy_(1.0 + 0.1 * noise if is_norm else 0.08 * noise)


def build_hf(hf_cfg) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    randomize(model)
    model.generation_config.eos_token_id = None  # generate exactly NEW tokens
    return model


class HFLog:
    """Collects transformers' warnings (its logger does not propagate to the root logger)."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.messages.append(record.getMessage())

    def __enter__(self) -> HFLog:
        logging.getLogger("transformers").addHandler(self.handler)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("transformers").removeHandler(self.handler)


def hf_load(path: Path) -> torch.nn.Module:
    """AutoModelForCausalLM.from_pretrained, asserting transformers warned about nothing: no
    missing / unexpected / newly initialised keys (its LOAD REPORT), no config or RoPE complaint."""
    with HFLog() as log:
        model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    assert not log.messages, log.messages
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, HF model, its save_pretrained dir, our model imported from that dir)."""
    hf = build_hf(FAMILIES[request.param]())
    path = tmp_path_factory.mktemp(request.param) / "hf"
    hf.save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return request.param, hf, path, from_hf(path)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """4 rows of T tokens: full, right-padded, and two left-padded with different lengths."""
    ids = torch.randint(3, V, (4, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, T, dtype=torch.long)
    mask[1, 13:] = 0  # right padding
    mask[2, :11] = 0  # left padding, 9 real tokens
    mask[3, :3] = 0  # left padding, 17 real tokens
    return ids.masked_fill(mask == 0, 0), mask


def test_logits_parity_with_right_and_left_padding(family):
    name, hf, _, ours = family
    ids, mask = padded_batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask)
        unpadded = ours(ids[:1])
    real = mask.bool()
    assert ref[real].abs().amax() > 0.5  # logits big enough for 1e-5 to be a real check
    torch.testing.assert_close(got[real], ref[real], atol=ATOL, rtol=0)
    assert torch.isfinite(got).all()
    # No query row is fully masked: some SDPA kernels return NaN for those (torch 2.13 on CPU: 0).
    assert ours._mask(0, T, ids.device, mask).any(-1).all()
    # A full row with a mask of ones equals the unmasked forward.
    torch.testing.assert_close(got[:1], unpadded, atol=ATOL, rtol=0)


def greedy(model: Transformer, ids: torch.Tensor, mask: torch.Tensor, steps: int):
    """Greedy decoding through our KV cache with transformers' generate conventions for padding:
    positions cumsum(mask) - 1, and the mask grows by one real token per step.
    Returns the new tokens (B, steps) and the logits that chose them (steps, B, V)."""
    B, P = ids.shape
    cache = KVCache(model, B, P + steps)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    logits = model(ids, cache=cache, attention_mask=mask, position_ids=pos)[:, -1]
    out, scores = [], []
    for _ in range(steps):
        nxt = logits.argmax(-1, keepdim=True)  # (B, 1)
        out.append(nxt)
        scores.append(logits)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        pos = pos[:, -1:] + 1
        logits = model(nxt, cache=cache, attention_mask=mask, position_ids=pos)[:, -1]
    return torch.cat(out, dim=1), torch.stack(scores)


def test_greedy_generation_matches_hf_generate_with_left_padding(family):
    name, hf, _, ours = family
    ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left-padded second prompt
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=0,
                          return_dict_in_generate=True, output_logits=True)
        got, logits = greedy(ours, ids, mask, NEW)
    assert torch.equal(got, ref.sequences[:, ids.shape[1]:])
    # Tiny random models often repeat a token: the logits of every step are the sharper check.
    torch.testing.assert_close(logits, torch.stack(ref.logits), atol=ATOL, rtol=0)


def test_eval_generate_matches_hf_generate(family):
    name, hf, _, ours = family
    prompt = [5, 17, 42, 8]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, pad_token_id=0)
    got = generate(ours, prompt, NEW, temperature=0.0)
    assert got == [ref[0, len(prompt):].tolist()]


def test_import_export_import_is_lossless_and_hf_loads_the_export(family, tmp_path):
    name, hf, _, ours = family
    to_hf(ours, tmp_path, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "generation_config.json",
                                                          "model.safetensors"]
    again = from_hf(tmp_path)
    assert again.cfg == ours.cfg
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Tied weights are written once, in HF's names, contiguous.
    written = load_file(tmp_path / "model.safetensors")
    assert written.keys() == {k for k in hf.state_dict() if not k.endswith(".attn.bias")} - (
        {"lm_head.weight"} if ours.cfg.tie_embeddings else set()
    )
    back = hf_load(tmp_path)
    ref_sd = hf.state_dict()
    for key, value in back.state_dict().items():
        assert torch.equal(value, ref_sd[key]), key
    ids, mask = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids, attention_mask=mask).logits,
                                   hf(input_ids=ids, attention_mask=mask).logits, atol=0, rtol=0)
    assert back.generation_config.eos_token_id == 2 and back.config.bos_token_id == 1


def test_sharded_export_and_import(family, tmp_path):
    name, hf, _, ours = family
    old = tmp_path / "model.safetensors"
    old.write_bytes(b"stale")  # an earlier single-file export must not shadow the shards
    files = to_hf(ours, tmp_path, max_shard_size=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not old.exists() and all(p.exists() for p in files)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for s in shards for t in load_file(tmp_path / s).values()
    )
    again = from_hf(tmp_path)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in ours.state_dict().items())
    back = hf_load(tmp_path)
    ids = torch.randint(3, V, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, hf(input_ids=ids).logits, atol=0, rtol=0)


def test_import_of_a_sharded_checkpoint_saved_by_transformers(tmp_path):
    hf = build_hf(FAMILIES["llama"]())
    hf.save_pretrained(tmp_path, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = from_hf(tmp_path)
    ids = torch.randint(3, V, (2, T), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=ATOL, rtol=0)


def test_export_in_bfloat16(family, tmp_path):
    name, hf, _, ours = family
    to_hf(ours, tmp_path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "model.safetensors").values())
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    again = from_hf(tmp_path)  # float32 by default, the bf16 values exactly
    assert all(torch.equal(v.bfloat16().float(), again.state_dict()[k]) for k, v in ours.state_dict().items())
    low = from_hf(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in low.parameters())
    assert all(b.dtype == torch.float32 for b in low.buffers())  # RoPE tables stay float32


def test_base_model_checkpoint_without_prefix(tmp_path):
    """The original `gpt2` checkpoint is a GPT2Model: names without `transformer.`, tied head."""
    hf = build_hf(FAMILIES["gpt2"]())
    hf.transformer.save_pretrained(tmp_path)
    assert "wte.weight" in load_file(tmp_path / "model.safetensors")
    ours = from_hf(tmp_path)
    ids = torch.randint(3, V, (2, T), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=ATOL, rtol=0)


def test_load_pretrained_into_an_existing_model(family):
    name, hf, path, ours = family
    target = Transformer(ours.cfg)  # random init
    load_pretrained(path, target)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in ours.state_dict().items())
    wrong = Transformer(ours.cfg.model_copy(update={"n_layers": 3}))
    with pytest.raises(LmforgeError, match="n_layers: model 3"):
        load_pretrained(path, wrong)


SCALED = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("kind", list(SCALED))
def test_rope_scaling_carries_over_import_and_export(kind, tmp_path):
    max_pos = 16 if kind == "dynamic" else 64  # dynamic is relative to max_position_embeddings
    hf_cfg = transformers.LlamaConfig(
        **COMMON, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=max_pos, rope_theta=5e5, rope_scaling=dict(SCALED[kind]),
    )
    hf = build_hf(hf_cfg)
    hf.save_pretrained(tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    assert ours.cfg.rope_scaling.type == kind and ours.cfg.rope_theta == 5e5
    if kind == "dynamic":
        assert ours.cfg.max_seq_len == 32 and ours.cfg.rope_scaling.original_max_position_embeddings == 16
    ids = torch.randint(3, V, (2, 30), generator=torch.Generator().manual_seed(5))  # 30 > 16
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        torch.testing.assert_close(ours(ids), ref, atol=ATOL, rtol=0)
    to_hf(ours, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: written["rope_parameters"][k] for k in SCALED[kind]} == SCALED[kind]
    assert written["rope_parameters"]["rope_theta"] == 5e5
    back = hf_load(tmp_path / "out")  # e.g. no "unrecognized keys in rope_parameters" warning
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, ref, atol=0, rtol=0)
    assert from_hf(tmp_path / "out").cfg == ours.cfg


def test_qwen2_sliding_window_export_matches_hf(tmp_path):
    from lmforge.config import ModelConfig

    torch.manual_seed(0)
    ours = Transformer(ModelConfig(vocab_size=V, d_model=32, d_ff=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                   max_seq_len=64, qkv_bias=True, sliding_window=5, init_std=0.1))
    to_hf(ours, tmp_path)
    back = hf_load(tmp_path)
    assert back.config.model_type == "qwen2" and back.config.layer_types == ["sliding_attention"] * 2
    ids = torch.randint(3, V, (2, T), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), back(input_ids=ids).logits, atol=ATOL, rtol=0)
    assert from_hf(tmp_path).cfg.sliding_window == 5


def test_old_style_rope_keys_are_read(tmp_path):
    """transformers 4.x wrote top-level rope_theta + rope_scaling (with `type`) instead of rope_parameters."""
    hf = transformers.LlamaConfig(**COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4).to_dict()
    hf.pop("rope_parameters")
    hf.update(rope_theta=123456.0, rope_scaling={"type": "linear", "factor": 4.0})
    cfg = hf_to_model_config(hf)
    assert cfg.rope_theta == 123456.0 and cfg.rope_scaling.type == "linear" and cfg.rope_scaling.factor == 4.0


def base_config(model_type: str) -> dict:
    factory = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gpt2": "gpt2"}[model_type]
    return FAMILIES[factory]().to_dict()


@pytest.mark.parametrize(
    "model_type, change, field",
    [
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
         "rope_type.*proportional"),
        ("llama", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "short_factor"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
                   "layer_types": None}, "max_window_layers"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ("gpt2", {"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
        ("gpt2", {"activation_function": "relu"}, "activation_function"),
        ("gpt2", {"resid_pdrop": 0.1}, "resid_pdrop"),
        ("gpt2", {"model_type": "falcon"}, "model_type 'falcon'"),
    ],
)
def test_unsupported_config_fields_are_rejected_by_name(model_type, change, field):
    hf = {**base_config(model_type), **change}
    with pytest.raises(LmforgeError, match=field):
        hf_to_model_config(hf)


def test_qwen2_sliding_window_on_every_layer_is_supported():
    hf = {**base_config("qwen2"), "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0,
          "layer_types": None}
    assert hf_to_model_config(hf).sliding_window == 4
    assert hf_to_model_config(base_config("qwen2")).sliding_window is None


def test_unsupported_fields_are_rejected_when_loading_a_dir(tmp_path):
    hf = build_hf(FAMILIES["llama_tied"]())
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_act"] = "relu"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LmforgeError, match="hidden_act='relu'"):
        from_hf(tmp_path)


def copy_with(path: Path, dest: Path, drop: str | None = None, add: str | None = None) -> Path:
    dest.mkdir()
    (dest / "config.json").write_text((path / "config.json").read_text())
    sd = load_file(path / "model.safetensors")
    if drop:
        del sd[drop]
    if add:
        sd[add] = torch.zeros(3)
    save_file(sd, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_missing_and_unexpected_tensors_are_named(family, tmp_path):
    name, hf, path, ours = family
    drop = "transformer.h.1.attn.c_attn.weight" if name == "gpt2" else "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(LmforgeError, match=f"missing tensors: {re.escape(drop)}"):
        from_hf(copy_with(path, tmp_path / "missing", drop=drop))
    extra = "model.layers.0.self_attn.q_norm.weight"
    with pytest.raises(LmforgeError, match=f"unexpected tensors: {re.escape(extra)}"):
        from_hf(copy_with(path, tmp_path / "extra", add=extra))


def test_pickled_weights_only_are_refused(tmp_path):
    hf = build_hf(FAMILIES["llama_tied"]())
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(LmforgeError, match="safetensors only"):
        from_hf(tmp_path)


def test_configs_that_hf_cannot_express_are_refused_on_export():
    from lmforge.config import ModelConfig

    with pytest.raises(LmforgeError, match="norm=rmsnorm"):
        model_config_to_hf(ModelConfig(vocab_size=V, pos_embedding="learned", mlp="gelu_tanh", bias=True))
    with pytest.raises(LmforgeError, match="mlp=gelu"):
        model_config_to_hf(ModelConfig(vocab_size=V, mlp="gelu"))
    with pytest.raises(LmforgeError, match="Mistral has no biases"):
        model_config_to_hf(ModelConfig(vocab_size=V, sliding_window=8, bias=True), model_type="mistral")
    # Inferred members: qkv bias -> qwen2, a window -> mistral, else llama.
    assert model_config_to_hf(ModelConfig(vocab_size=V, qkv_bias=True))["model_type"] == "qwen2"
    assert model_config_to_hf(ModelConfig(vocab_size=V, sliding_window=8))["model_type"] == "mistral"
    assert model_config_to_hf(ModelConfig(vocab_size=V))["model_type"] == "llama"
