"""LoRA / DoRA on our T5 (models/t5.py) against PEFT on transformers' T5ForConditionalGeneration, float32.

A random tiny T5 (1.0: ReLU, tied, rescaled; v1.1: gated-GELU, untied) is imported into lmforge; adapters
travel both ways through PEFT's files: our `save_peft_adapter` -> `PeftModel.from_pretrained` and PEFT's
`save_pretrained` -> our `load_peft_adapter`. Logits (a padded encoder batch, a decoder deeper than the
encoder), the gradients of every adapter tensor and the merged weights (`merge_lora` vs `merge_and_unload`,
and our merged model exported by `to_hf`) agree within 1e-5. Target names: lmforge's, T5's (q, wi_0,
EncDecAttention.v, ...), all-linear; what a T5 cannot take is refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lmforge.errors import ConfigError  # noqa: E402
from lmforge.finetune.lora import apply_lora, lora_layers, merge_lora  # noqa: E402
from lmforge.finetune.peft_io import load_peft_adapter, save_peft_adapter  # noqa: E402
from lmforge.models.hf import from_hf, t5, to_hf  # noqa: E402

V, S, T, ATOL = 97, 13, 9, 1e-5
# Weights N(0, 0.08), as the Llama LoRA test has them: with test_t5_hf.py's 0.2 T5's unscaled attention
# scores are sharp enough that a float32 rounding difference between two correct adapter sums (ours fuses
# B A into the base GEMM, PEFT adds it after) grows to 5e-5 through five blocks; transformers' T5 rounds its
# norms and softmax in float32 even in float64, so float64 cannot separate rounding from maths here.
STD = 0.08
VARIANTS = {
    "t5": {"feed_forward_proj": "relu"},  # T5 1.0: tied, rescaled
    "v1_1": {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},  # v1.1 / Flan-T5
}
PEFT_PARAM = {"lora_A": "lora_A.default.weight", "lora_B": "lora_B.default.weight",
              "lora_magnitude": "lora_magnitude_vector.default.weight"}


def hf_model(variant: str):
    cfg = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                num_decoder_layers=3, relative_attention_num_buckets=8,
                                relative_attention_max_distance=12,
                                dropout_rate=0.0, layer_norm_epsilon=1e-6, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1, **VARIANTS[variant])
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random everywhere: unit norms would hide swapped tensors
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "layer_norm" in name
                    else torch.randn(p.shape, generator=g) if name == "shared.weight"  # T5's own N(0, 1)
                    else STD * torch.randn(p.shape, generator=g))
        if variant == "v1_1":  # transformers 5 ties at construction; a loaded Flan-T5 has its own head
            head = 0.2 * torch.randn(model.lm_head.weight.shape, generator=g)
            model.lm_head.weight = torch.nn.Parameter(head)
    return model


def pair(variant: str, tmp_path):
    """(transformers' T5, ours imported from its saved dir): the same model, logits within 1e-5."""
    hf = hf_model(variant)
    hf.save_pretrained(tmp_path / "base")
    return hf, from_hf(tmp_path / "base").eval()


def batch():
    """(encoder ids, attention mask with a right- and a left-padded row, decoder ids)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, V, (3, S), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, :4] = 0
    dec = torch.randint(2, V, (3, T), generator=g)
    dec[:, 0] = 0
    return torch.where(mask.bool(), ids, 0), mask, dec


def logits_pair(ours, theirs):
    ids, mask, dec = batch()
    return ours(ids, dec, attention_mask=mask), theirs(input_ids=ids, attention_mask=mask,
                                                       decoder_input_ids=dec).logits


def perturb_magnitudes(model, seed: int) -> None:
    # At init DoRA's m equals ||W + sBA||, which hides the m / ||.|| scaling: move it.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"lora_magnitude", name):
                p.mul_(1.0 + 0.2 * torch.randn(p.shape, generator=g))


def assert_same(ours, peft_model, keys) -> None:
    """Equal logits, adapter gradients and merged weights (PEFT's merge_and_unload vs merge_lora)."""
    got, ref = logits_pair(ours, peft_model)
    assert ref.abs().amax() > 0.5  # logits big enough for 1e-5 to be a real check
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    target = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(4))
    F.cross_entropy(ref.reshape(-1, V), target.reshape(-1)).backward()
    F.cross_entropy(got.reshape(-1, V), target.reshape(-1)).backward()
    for name, layer in lora_layers(ours).items():
        theirs = peft_model.get_submodule("base_model.model." + keys.to_hf(name + ".weight")[:-7])
        for pname, p in layer.named_parameters(recurse=False):
            g_ref = theirs.get_parameter(PEFT_PARAM[pname]).grad
            assert g_ref.abs().amax() > 1e-4, f"{name}.{pname}: gradient too small to compare"
            torch.testing.assert_close(p.grad, g_ref, atol=ATOL, rtol=0, msg=f"{name}.{pname}")
    with torch.no_grad():
        merged_ref = peft_model.merge_and_unload().state_dict()
        merged = merge_lora(ours).state_dict()
        for key, w in merged_ref.items():
            ours_key = keys.to_ours(key)
            if ours_key in merged:  # the stacks' embed_tokens are transformers' copies of `shared`
                torch.testing.assert_close(merged[ours_key], w, atol=ATOL, rtol=0, msg=key)
        got, ref = logits_pair(ours, peft_model)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


# (variant, targets, wrapped layers, PEFT target_modules written, dora, rslora)
CASES = [
    ("t5", "all-linear", 2 * 6 + 3 * 10, ["q", "k", "v", "o", "wi", "wo"], False, False),
    ("v1_1", ["q", "v", "wi_0", "wi_1", "DenseReluDense.wo", "lm_head"], 2 * 5 + 3 * 7 + 1,
     ["q", "v", "wi_0", "wi_1", "wo", "lm_head"], False, True),
    ("v1_1", ["EncDecAttention.k", "SelfAttention.o", "decoder.layers.*.mlp.w_gate"], 3 + 5 + 3,
     None, True, False),
]


@pytest.mark.parametrize(("variant", "targets", "n", "written", "dora", "rslora"), CASES)
def test_our_t5_adapter_loads_into_peft(tmp_path, variant, targets, n, written, dora, rslora):
    hf, ours = pair(variant, tmp_path)
    # scaling 2 either way: seeded adapters much larger than the base would make the model as sharp as STD 0.2
    apply_lora(ours, targets, r=4, alpha=4 if rslora else 8, dora=dora, rslora=rslora, init="seeded", seed=5)
    assert len(lora_layers(ours)) == n
    assert all(p.requires_grad == ("lora_" in name) for name, p in ours.named_parameters())
    if dora:
        perturb_magnitudes(ours, seed=6)
    save_peft_adapter(ours, tmp_path / "adapter", str(tmp_path / "base"), ours.cfg)
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["task_type"] == "SEQ_2_SEQ_LM" and saved["use_dora"] is dora
    if written is not None:  # leaf names where every layer of a kind is wrapped
        assert saved["target_modules"] == written
    else:  # some of a kind: full module names, which PEFT matches exactly
        assert "decoder.block.2.layer.1.EncDecAttention.k" in saved["target_modules"]
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True)
    assert type(peft_model).__name__ == "PeftModelForSeq2SeqLM"
    assert_same(ours, peft_model, t5.KEYS[variant == "v1_1"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_peft_t5_adapter_loads_into_ours(tmp_path, variant):
    hf, ours = pair(variant, tmp_path)
    ff = ["wi"] if variant == "t5" else ["wi_0", "wi_1"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "k", "v", "o", *ff, "wo"],
                             init_lora_weights=False, task_type="SEQ_2_SEQ_LM")
    torch.manual_seed(3)
    peft_model = peft.get_peft_model(hf, config)
    peft_model.save_pretrained(tmp_path / "adapter")
    wrapped = load_peft_adapter(ours, tmp_path / "adapter")
    assert "decoder.layers.2.cross.wv" in wrapped and "encoder.layers.1.mlp.w_down" in wrapped
    assert len(wrapped) == 2 * (4 + len(ff) + 1) + 3 * (8 + len(ff) + 1)
    assert_same(ours, peft_model, t5.KEYS[variant == "v1_1"])


def test_merged_t5_exports_with_equal_logits(tmp_path):
    hf, ours = pair("v1_1", tmp_path)
    apply_lora(ours, "all-linear", r=4, alpha=8, init="seeded", seed=9)
    with torch.no_grad():
        ids, mask, dec = batch()
        want = ours(ids, dec, attention_mask=mask)
        to_hf(merge_lora(ours), tmp_path / "merged")
        loaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "merged").eval()
        got = loaded(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        base = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        assert (want - base).abs().amax() > 0.1  # the adapters changed the model
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("targets", "message"), [
    (["wo"], r"'wo' is ambiguous on a T5"),
    (["q_proj"], r"'q_proj' .* matches no linear layer.*EncDecAttention\.q"),
    (["lm_head"], r"'lm_head' .* matches no linear layer"),  # T5 1.0 ties its head: no output layer
])
def test_t5_targets_refused_by_name(tmp_path, targets, message):
    _, ours = pair("t5", tmp_path)
    with pytest.raises(ConfigError, match=message):
        apply_lora(ours, targets)
    assert not lora_layers(ours)
