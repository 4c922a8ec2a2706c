"""Mixture-of-experts models against transformers: tiny random Mixtral, Qwen2-MoE and OLMoE saved by
transformers import with equal float32 logits (1e-5), export to a dir transformers loads with equal
logits, and our balance loss equals transformers' load_balancing_loss_func, for one layer and for all
layers as transformers aggregates them (f and P pooled over layers: our aux_loss_scope=model)."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.errors import LmforgeError
from lmforge.models.hf import from_hf, hf_to_model_config, load_pretrained, to_hf
from lmforge.models.moe import moe_layers, router_losses
from lmforge.models.transformer import build_model

transformers = pytest.importorskip("transformers")

V, T, ATOL = 96, 16, 1e-5
SHAPE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, num_experts_per_tok=2, tie_word_embeddings=False, eos_token_id=2,
             pad_token_id=0, bos_token_id=1)
FAMILIES = {
    # Mixtral: 5 experts, renormalised top-2, a sliding window shorter than T.
    "mixtral": lambda: transformers.MixtralConfig(**SHAPE, intermediate_size=40, num_local_experts=5,
                                                  sliding_window=6, rope_theta=1e6),
    # Qwen2-MoE: expert width != shared width != intermediate_size, q/k/v biases, unnormalised top-k.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SHAPE, intermediate_size=56, moe_intermediate_size=24,
                                                     shared_expert_intermediate_size=40, num_experts=6,
                                                     norm_topk_prob=False, use_sliding_window=False),
    # Qwen2-MoE with renormalised top-k weights.
    "qwen2_moe_norm": lambda: transformers.Qwen2MoeConfig(
        **SHAPE, intermediate_size=56, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        num_experts=4, norm_topk_prob=True),
    # OLMoE: q/k RMSNorm over the whole projections, attention biases.
    "olmoe": lambda: transformers.OlmoeConfig(**SHAPE, intermediate_size=24, num_experts=6,
                                              norm_topk_prob=False, attention_bias=True),
}
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights everywhere, norms around 1 (HF inits norms to 1 and biases to 0, which hides bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    config = FAMILIES[request.param]()
    model = getattr(transformers, CLASSES[config.model_type])(config).eval()
    randomize(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path, model


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, V, (2, T), generator=torch.Generator().manual_seed(seed))


def test_import_gives_equal_logits(hf_dir):
    path, hf = hf_dir
    ours = from_hf(path).eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=ATOL)


def test_greedy_generation_matches_hf_generate(hf_dir):
    """16 new tokens through our KV cache (a left-padded row too), as transformers' generate picks them;
    every step's logits compared (tiny random models repeat tokens)."""
    from test_hf_import_export import greedy  # the same decoding loop as the dense families

    path, hf = hf_dir
    ours = from_hf(path).eval()
    ids = _ids(2)[:, :7]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0,
                          eos_token_id=None, return_dict_in_generate=True, output_logits=True)
        got, logits = greedy(ours, ids, mask, 16)
    assert torch.equal(got, ref.sequences[:, ids.shape[1]:])
    torch.testing.assert_close(logits, torch.stack(ref.logits), atol=ATOL, rtol=0)


def test_export_loads_in_transformers_with_equal_logits(hf_dir, tmp_path):
    path, hf = hf_dir
    ours = from_hf(path).eval()
    out = tmp_path / "export"
    to_hf(ours, out)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == hf.config.model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == type(hf).__name__
    ids = _ids(1)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, rtol=0, atol=ATOL)
    # And the exported dir loads back into an existing model (init_from) whose training settings
    # (balance/z-loss weights, capacity, bias balancing) differ from the checkpoint's: the same weights.
    training = dict(aux_loss_coef=0.5, aux_loss_scope="layer", z_loss_coef=1e-3, capacity_factor=1.25,
                    bias_balancing=True)
    model = build_model(ours.cfg.model_copy(update={"moe": ours.cfg.moe.model_copy(update=training)}))
    load_pretrained(out, model)
    theirs = model.state_dict()
    for k, a in ours.state_dict().items():
        assert torch.equal(a, theirs[k]), k
    wider = ours.cfg.model_copy(update={"moe": ours.cfg.moe.model_copy(update={"top_k": 1})})
    with pytest.raises(LmforgeError, match="moe: model"):
        load_pretrained(out, build_model(wider))


def test_fused_expert_layout_imports_too(hf_dir, tmp_path):
    """transformers 5 holds experts as fused gate_up_proj / down_proj: a file in that layout reads alike."""
    path, hf = hf_dir
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = from_hf(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()), hf(_ids()).logits, rtol=0, atol=ATOL)


def test_balance_loss_equals_transformers(hf_dir):
    path, hf = hf_dir
    family = __import__(type(hf).__module__, fromlist=["load_balancing_loss_func"])
    ours = from_hf(path)
    assert ours.cfg.moe.aux_loss_scope == "model"
    assert ours.cfg.moe.aux_loss_coef == hf.config.router_aux_loss_coef
    ids = _ids(2)
    hf.train()
    out = hf(ids, labels=ids, output_router_logits=True)
    E, k = ours.cfg.moe.n_experts, ours.cfg.moe.top_k
    ours.train()
    ours(ids)
    layers = moe_layers(ours)
    # All layers, pooled as transformers does.
    mine = router_losses(layers)
    assert mine.metrics["moe_aux_loss"].item() == pytest.approx(out.aux_loss.item(), rel=1e-5)
    # One layer: the same function on that layer's router logits alone.
    theirs = family.load_balancing_loss_func((out.router_logits[1],), E, k)
    assert router_losses([layers[1]]).metrics["moe_aux_loss"].item() == pytest.approx(theirs.item(), rel=1e-5)
    # The per-layer scope averages per-layer losses instead: different unless the layers agree.
    per_layer = [family.load_balancing_loss_func((lg,), E, k) for lg in out.router_logits]
    ours_layer_scope = sum(router_losses([m]).metrics["moe_aux_loss"] for m in layers) / len(layers)
    assert ours_layer_scope.item() == pytest.approx(torch.stack(per_layer).mean().item(), rel=1e-5)


@pytest.mark.parametrize("key,value,needle", [
    ("decoder_sparse_step", 2, "decoder_sparse_step"),
    ("mlp_only_layers", [0], "mlp_only_layers"),
    ("use_sliding_window", True, "use_sliding_window"),
])
def test_qwen2_moe_settings_lmforge_cannot_build_are_refused(key, value, needle):
    hf = FAMILIES["qwen2_moe"]().to_dict()
    hf[key] = value
    if key == "use_sliding_window":
        hf["sliding_window"], hf["layer_types"] = 4, None  # transformers' default: every other layer
    with pytest.raises(LmforgeError, match=needle):
        hf_to_model_config(hf)


def test_olmoe_clip_qkv_and_export_mismatch_are_refused(tmp_path):
    hf = FAMILIES["olmoe"]().to_dict()
    hf["clip_qkv"] = 8.0
    with pytest.raises(LmforgeError, match="clip_qkv"):
        hf_to_model_config(hf)
    cfg = hf_to_model_config(FAMILIES["mixtral"]().to_dict())
    balanced = cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"bias_balancing": True})})
    with pytest.raises(LmforgeError, match="bias_balancing"):
        to_hf(build_model(balanced), tmp_path / "x")
    with pytest.raises(LmforgeError, match="Mixtral always renormalises"):
        unnormalised = cfg.moe.model_copy(update={"norm_topk_prob": False})
        to_hf(build_model(cfg.model_copy(update={"moe": unnormalised})), tmp_path / "y", model_type="mixtral")
