"""LoRA / rsLoRA / DoRA against PEFT on a tiny random Llama with grouped-query attention.

Adapters travel both ways through the files: PEFT's `save_pretrained` -> our `load_peft_adapter`, and
our `save_peft_adapter` -> PEFT's `PeftModel.from_pretrained`. Then logits, gradients of every adapter
tensor and merged weights against `merge_and_unload` must agree: within 1e-5 in float32, and within
1e-12 in float64, where rounding cannot hide a difference in the maths.

transformers runs its SDPA attention, the kernel lmforge calls, so that the two base models agree bit
for bit (on the machines measured; asserted within a tenth of the tolerance, as other CPUs may differ in
the last bits) and every difference is the adapters'. In float32 the adapters' own
rounding differs from PEFT's (lmforge fuses them into the base GEMMs and stacks the A's of layers that
share an input); through two layers it reaches a few 1e-6 on gradients near 1.5. In float64 the same
check is seven orders of magnitude tighter.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lmforge.finetune.lora import apply_lora, lora_layers, merge_lora  # noqa: E402
from lmforge.finetune.peft_io import load_peft_adapter, save_peft_adapter  # noqa: E402
from lmforge.models import Transformer  # noqa: E402
from lmforge.models.hf import llama  # noqa: E402
from lmforge.models.hf.convert import hf_to_model_config  # noqa: E402

V, T = 128, 16
ATOL = {torch.float32: 1e-5, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.float64]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (use_dora, use_rslora, biases in every linear layer)
CASES = [(False, False, False), (False, True, True), (True, False, True), (True, True, False)]
PEFT_PARAM = {"lora_A": "lora_A.default.weight", "lora_B": "lora_B.default.weight",
              "lora_magnitude": "lora_magnitude_vector.default.weight"}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Random weights and biases everywhere (HF inits biases to 0 and norms to 1, which would hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)


def base_pair(bias: bool, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Transformer]:
    """The same random Llama as transformers' LlamaForCausalLM and as our Transformer, in `dtype`,
    with equal logits (bit for bit on the machines measured)."""
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=bias, mlp_bias=bias,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).float()
    randomize(hf, seed=0)
    ours = Transformer(hf_to_model_config(cfg.to_dict()))
    ours.load_state_dict({llama.KEYS.to_ours(k): v for k, v in hf.state_dict().items()}, strict=True)
    hf.to(dtype)
    ours.to(dtype)
    with torch.no_grad():  # bit-equal on the machines measured; other CPUs may differ in the last bits
        torch.testing.assert_close(ours(ids()), hf(input_ids=ids()).logits, atol=ATOL[dtype] / 10, rtol=0)
    return hf, ours


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), ids(seed=2).reshape(-1))


def peft_module(peft_model: torch.nn.Module, our_name: str) -> torch.nn.Module:
    hf_name = llama.KEYS.to_hf(our_name + ".weight").removesuffix(".weight")
    return peft_model.get_submodule("base_model.model." + hf_name)


def perturb_magnitudes(model: torch.nn.Module, seed: int) -> None:
    # At init DoRA's m equals ||W + sBA||, which hides the m / ||.|| scaling: move it.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"lora_magnitude", name):
                p.mul_(1.0 + 0.2 * torch.randn(p.shape, generator=g))


def assert_same(ours: Transformer, peft_model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Equal logits, equal adapter gradients, equal merged weights (within ATOL[dtype])."""
    atol = ATOL[dtype]
    assert all(p.dtype == dtype for p in [*ours.parameters(), *peft_model.parameters()])
    x = ids()
    ref = peft_model(input_ids=x).logits
    got = ours(x)
    assert ref.abs().amax() > 0.5  # logits big enough for 1e-5 to be a real check
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)

    loss_of(ref).backward()
    loss_of(got).backward()
    layers = lora_layers(ours)
    assert len(layers) == 14  # 7 kinds x 2 layers
    for name, layer in layers.items():
        theirs = peft_module(peft_model, name)
        for pname, p in layer.named_parameters(recurse=False):
            g_ref = theirs.get_parameter(PEFT_PARAM[pname]).grad
            assert g_ref.abs().amax() > 1e-3, f"{name}.{pname}: gradient too small to compare"
            torch.testing.assert_close(p.grad, g_ref, atol=atol, rtol=0, msg=f"{name}.{pname}")

    with torch.no_grad():
        merged_ref = peft_model.merge_and_unload().state_dict()
        merged = merge_lora(ours).state_dict()
    assert set(merged) == {llama.KEYS.to_ours(k) for k in merged_ref}
    for key, w in merged_ref.items():
        torch.testing.assert_close(merged[llama.KEYS.to_ours(key)], w, atol=atol, rtol=0, msg=key)
    x2 = ids(seed=3)
    torch.testing.assert_close(ours(x2), peft_model(input_ids=x2).logits, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dora,rslora,bias", CASES)
def test_peft_adapter_loads_into_ours(tmp_path, dora, rslora, bias, dtype):
    hf, ours = base_pair(bias, dtype)
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=TARGETS, init_lora_weights=False,
                             use_dora=dora, use_rslora=rslora)
    peft_model = peft.get_peft_model(hf, config)
    if dora:
        perturb_magnitudes(peft_model, seed=4)
    peft_model.save_pretrained(tmp_path)

    wrapped = load_peft_adapter(ours, tmp_path, dtype=dtype)
    assert "layers.1.attn.wk" in wrapped and "output" not in wrapped
    assert all(p.requires_grad == ("lora_" in n) for n, p in ours.named_parameters())
    assert_same(ours, peft_model, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dora,rslora,bias", CASES)
def test_our_adapter_loads_into_peft(tmp_path, dora, rslora, bias, dtype):
    hf, ours = base_pair(bias, dtype)
    apply_lora(ours, TARGETS, r=4, alpha=12, rslora=rslora, dora=dora, init="seeded", seed=5, dtype=dtype)
    if dora:
        perturb_magnitudes(ours, seed=6)
    save_peft_adapter(ours, tmp_path, "tiny-llama", ours.cfg)

    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["target_modules"] == TARGETS and saved["use_dora"] is dora and saved["use_rslora"] is rslora
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path, is_trainable=True).to(dtype)
    assert_same(ours, peft_model, dtype)


@pytest.mark.parametrize("dora", [False, True])
def test_dropout_in_training_matches_peft(tmp_path, dora):
    """PEFT's dropout semantics, DoRA's separate W·dropout(x) included: same RNG draws, same logits."""
    hf, ours = base_pair(bias=True)
    apply_lora(ours, "all-linear", r=4, alpha=8, dropout=0.25, dora=dora, init="seeded", seed=7)
    if dora:
        perturb_magnitudes(ours, seed=8)
    save_peft_adapter(ours, tmp_path, None, ours.cfg)
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path, is_trainable=True)
    peft_model.train()
    ours.train()
    x = ids()
    torch.manual_seed(11)
    ref = peft_model(input_ids=x).logits
    torch.manual_seed(11)
    got = ours(x)
    torch.testing.assert_close(got, ref, atol=ATOL[torch.float32], rtol=0)
    ours.eval()
    assert (ours(x) - got).abs().amax() > 1e-2  # dropout did act in training
