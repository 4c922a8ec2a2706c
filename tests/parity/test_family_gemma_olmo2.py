"""OLMo 2, Gemma 2 and Gemma 3 (text) against transformers: tiny random models saved by transformers
import with equal float32 logits (1e-5), export to a dir transformers loads with equal logits, greedy
generation through our KV cache equals transformers' generate for 16 tokens past the sliding window,
and LoRA trained on the imported model, written as a PEFT adapter, gives PEFT's logits.

Shapes are odd on purpose: head_dim != d_model / n_heads, grouped-query attention with ratio 1 and 2,
tied and untied embeddings, a sliding window (5) shorter than the sequences. Norm weights are
randomised around their identity (1 for OLMo 2, 0 for Gemma's (1 + w) norms), which transformers'
init would hide. transformers runs its eager attention: the one that applies Gemma 2's soft-capping.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from lmforge.errors import LmforgeError
from lmforge.models.generation import sample_replies
from lmforge.models.hf import from_hf, hf_to_model_config, to_hf

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

V, T, NEW, ATOL = 96, 16, 16, 1e-5
COMMON = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, intermediate_size=40,
              max_position_embeddings=64, eos_token_id=2, pad_token_id=0, bos_token_id=1)
GEMMA = dict(head_dim=12, sliding_window=5, query_pre_attn_scalar=10)
CASES = {
    # OLMo 2: post-norm blocks, q/k norms over the whole projections; GQA 2, untied, head_dim 12 != 8.
    "olmo2": lambda: transformers.Olmo2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=12, tie_word_embeddings=False, rope_theta=500.0),
    # OLMo 2 with plain multi-head attention, tied embeddings, head_dim = d_model / n_heads, q/k/v/o biases.
    "olmo2_mha_tied": lambda: transformers.Olmo2Config(**COMMON, num_attention_heads=4, num_key_value_heads=4,
                                                       tie_word_embeddings=True, attention_bias=True),
    # Gemma 2: soft-capped scores (small cap, so it binds) and logits, sliding / full / sliding layers.
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, **GEMMA, num_attention_heads=4,
                                                num_key_value_heads=2, attn_logit_softcapping=3.0,
                                                final_logit_softcapping=4.0),
    # Gemma 2, untied, MHA, its own layer pattern, no soft-capping, q/k/v/o biases.
    "gemma2_mha_untied": lambda: transformers.Gemma2Config(
        **COMMON, **GEMMA, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
        attention_bias=True,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], attn_logit_softcapping=None,
        final_logit_softcapping=None),
    # Gemma 3: per-head (1 + w) q/k norms; sliding layers rotate with their own base (100), the full
    # layer with rope_theta and linear scaling; tied, GQA 2.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **COMMON, **GEMMA, num_attention_heads=4, num_key_value_heads=2, rope_theta=1000.0,
        rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Gemma 3 with YaRN on its full layers past an original context of 8 positions.
    "gemma3_yarn": lambda: transformers.Gemma3TextConfig(
        **COMMON, **GEMMA, num_attention_heads=4, num_key_value_heads=2, rope_theta=1000.0,
        rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Gemma 3, MHA, untied, transformers' default layer pattern (here every layer slides), soft-capped
    # logits, q/k/v/o biases.
    "gemma3_mha_untied": lambda: transformers.Gemma3TextConfig(
        **COMMON, **GEMMA, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
        final_logit_softcapping=5.0, attention_bias=True),
}
CLASSES = {"olmo2": "Olmo2ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights; norm weights around their identity ((1 + w) norms: around 0). Embeddings and
    biases are small (Gemma scales embeddings by sqrt(d_model)): large ones make a random model repeat
    one token, and greedy generation would check little."""
    g = torch.Generator().manual_seed(seed)
    offset = 0.0 if model.config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            std = 0.05 if "embed" in name or name.endswith("bias") else 0.2
            p.copy_(offset + 0.1 * noise if "norm" in name else std * noise)


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tmp_path_factory):
    torch.manual_seed(0)
    config = CASES[request.param]()
    config._attn_implementation = "eager"
    hf = getattr(transformers, CLASSES[config.model_type])(config).eval()
    randomize(hf)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, path, hf, from_hf(path).eval()


def _ids(seed: int = 0, n: int = 2, t: int = T) -> torch.Tensor:
    return torch.randint(3, V, (n, t), generator=torch.Generator().manual_seed(seed))


def test_import_gives_equal_logits(family):
    from lmforge.models.flops import count_params

    _, _, hf, ours = family
    assert count_params(ours.cfg) == sum(p.numel() for p in ours.parameters())  # sandwich: 4 norms a block
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
        assert ref.abs().amax() > 0.5  # big enough for 1e-5 to be a real check
        torch.testing.assert_close(ours(ids), ref, rtol=0, atol=ATOL)


def test_export_loads_in_transformers_with_equal_logits(family, tmp_path):
    name, _, hf, ours = family
    to_hf(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == hf.config.model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == type(hf).__name__
    assert hf_to_model_config(written) == ours.cfg  # the round trip keeps every flag
    ids = _ids(1)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, rtol=0, atol=ATOL)


def test_greedy_generation_equals_transformers(family):
    """16 new tokens after prompts longer than the window: the cache, per-layer masks and positions
    agree with transformers' (sliding-window caches included); and a left-padded batch of two
    prompts gives each prompt's own continuation."""
    _, _, hf, ours = family
    prompts = [_ids(2, 1, 9)[0].tolist(), _ids(3, 1, 6)[0].tolist()]
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, pad_token_id=0,
                              eos_token_id=None)
        refs.append(out[0, len(p):].tolist())
    assert len(set(refs[0])) > 3  # not one token repeated: a real check of the cache
    assert sample_replies(ours, prompts[:1], NEW, set()) == refs[:1]
    assert sample_replies(ours, prompts, NEW, set()) == refs


def test_packed_rows_equal_separate_sequences(family):
    """SFT packs conversations into one row (segment ids, positions restarting): each segment's logits
    equal its own forward, with every layer kind's window and soft-capping applied within segments."""
    _, _, _, ours = family
    a, b = _ids(4, 1, 9), _ids(5, 1, 7)
    packed = torch.cat([a, b], 1)
    segments = torch.tensor([[0] * 9 + [1] * 7])
    positions = torch.tensor([list(range(9)) + list(range(7))])
    with torch.no_grad():
        got = ours(packed, position_ids=positions, segment_ids=segments)
        torch.testing.assert_close(got[:, :9], ours(a), rtol=0, atol=ATOL)
        torch.testing.assert_close(got[:, 9:], ours(b), rtol=0, atol=ATOL)


def test_lora_trained_on_the_import_loads_in_peft(family, tmp_path):
    """Fine-tuning smoke test: LoRA on every linear layer of the imported model, a few AdamW steps, the
    base exported and the adapter written in PEFT's format: PeftModel.from_pretrained gives our logits."""
    from lmforge.finetune.lora import apply_lora
    from lmforge.finetune.peft_io import save_peft_adapter

    _, path, _, _ = family
    ours = from_hf(path)
    apply_lora(ours, "all-linear", r=4, alpha=8, init="seeded", seed=3)
    opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-2)
    ids = _ids(6, 4, T)
    ours.train()
    losses = []
    for _ in range(4):
        loss = F.cross_entropy(ours(ids[:, :-1]).reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    ours.eval()
    save_peft_adapter(ours, tmp_path / "adapter", None, ours.cfg)
    base = from_hf(path)  # the untouched base, exported as the adapter's base model
    to_hf(base, tmp_path / "base")
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    ref = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    x = _ids(7)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(input_ids=x).logits, rtol=0, atol=ATOL)


# ------------------------------------------------------------------ each block flag on its own


def _cfg(**kw):
    from lmforge.config.schema import ModelConfig

    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


def _pair(base: dict | None = None, **kw):
    """Two models of config `base`, without and with the flags `kw`, holding the same weights (by name)."""
    from lmforge.models.transformer import build_model

    torch.manual_seed(0)
    plain, flagged = build_model(_cfg(**(base or {}))), build_model(_cfg(**(base or {}), **kw))
    with torch.no_grad():  # weights large enough that every flag moves the logits
        for name, p in plain.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
    flagged.load_state_dict(plain.state_dict(), strict=False)
    return plain.eval(), flagged.eval()


def test_offset_norm_scales_by_offset_plus_weight():
    from lmforge.models.common.norm import RMSNorm

    x = torch.randn(2, 5, 8)
    w = torch.randn(8)
    gemma, plain = RMSNorm(8, 1e-6, offset=1.0), RMSNorm(8, 1e-6)
    assert torch.equal(gemma.weight, torch.zeros(8))  # the identity of a (1 + w) norm
    with torch.no_grad():
        gemma.weight.copy_(w)
        plain.weight.copy_(1 + w)
    torch.testing.assert_close(gemma(x), plain(x), rtol=0, atol=1e-6)
    assert gemma(x.bfloat16()).dtype == torch.bfloat16


def test_geglu_gates_with_gelu_tanh():
    from lmforge.models.common.mlp import MLP

    torch.manual_seed(0)
    mlp = MLP(_cfg(mlp="geglu"))
    x = torch.randn(2, 3, 32)
    want = mlp.w_down(F.gelu(mlp.w_gate(x), approximate="tanh") * mlp.w_up(x))
    torch.testing.assert_close(mlp(x), want, rtol=0, atol=0)
    assert _cfg(mlp="geglu").resolved_d_ff == _cfg().resolved_d_ff  # a gated MLP's default width


def test_embed_scale_multiplies_embeddings_by_sqrt_d():
    plain, scaled = _pair(dict(tie_embeddings=False), embed_scale=True)
    ids = _ids()
    with torch.no_grad():
        before = plain(ids)
        assert (scaled(ids) - before).abs().amax() > 1e-2
        plain.tok_embeddings.weight.mul_(torch.tensor(32**0.5, dtype=torch.float32))
        torch.testing.assert_close(scaled(ids), plain(ids), rtol=0, atol=1e-5)


def test_query_pre_attn_scalar_sets_the_attention_scale():
    plain, same = _pair(query_pre_attn_scalar=8)  # head_dim 8: the default scale
    _, other = _pair(query_pre_attn_scalar=3)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(same(ids), plain(ids), rtol=0, atol=1e-5)
        assert (other(ids) - plain(ids)).abs().amax() > 1e-3


def test_attention_softcap_binds_only_when_small():
    plain, loose = _pair(attn_logit_softcap=1e6)
    _, tight = _pair(attn_logit_softcap=0.5)
    ids = _ids()
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :4] = 0  # left padding goes through the explicit attention's mask too
    with torch.no_grad():
        torch.testing.assert_close(loose(ids), plain(ids), rtol=0, atol=1e-5)
        real = mask.bool()
        got, want = loose(ids, attention_mask=mask), plain(ids, attention_mask=mask)
        torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)
        assert (tight(ids) - plain(ids)).abs().amax() > 1e-3


def test_final_softcap_bounds_the_logits_and_refuses_head():
    plain, capped = _pair(final_logit_softcap=0.05)
    ids = _ids()
    with torch.no_grad():
        ref = plain(ids)
        torch.testing.assert_close(capped(ids), torch.tanh(ref / 0.05) * 0.05, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="final_logit_softcap"):
        capped(ids, head=lambda h, w: h)


def test_layer_types_give_each_layer_its_window():
    ids = _ids(t=20)
    _, uniform = _pair(sliding_window=5)
    _, all_sliding = _pair(sliding_window=5, layer_types=["sliding_attention"] * 2)
    plain, all_full = _pair(sliding_window=5, layer_types=["full_attention"] * 2)
    _, mixed = _pair(sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    with torch.no_grad():
        torch.testing.assert_close(all_sliding(ids), uniform(ids), rtol=0, atol=0)
        torch.testing.assert_close(all_full(ids), plain(ids), rtol=0, atol=0)
        for other in (plain, uniform):
            assert (mixed(ids) - other(ids)).abs().amax() > 1e-4


def test_rope_local_theta_rotates_sliding_layers_only():
    types = ["sliding_attention", "full_attention"]
    _, same = _pair(sliding_window=5, layer_types=types, rope_local_theta=10000.0)  # = rope_theta
    _, mixed = _pair(sliding_window=5, layer_types=types)
    _, local = _pair(sliding_window=5, layer_types=types, rope_local_theta=37.0)
    ids = _ids(t=20)
    with torch.no_grad():
        torch.testing.assert_close(same(ids), mixed(ids), rtol=0, atol=0)
        assert (local(ids) - mixed(ids)).abs().amax() > 1e-4


@pytest.mark.parametrize("kw,needle", [
    (dict(layer_types=["full_attention"]), "one per layer"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window is not set"),
    (dict(rope_local_theta=100.0), "rope_local_theta"),
    (dict(norm="layernorm", norm_weight_offset=1.0), "norm_weight_offset"),
])
def test_impossible_combinations_are_refused(kw, needle):
    with pytest.raises(ValueError, match=needle):
        _cfg(**kw)


# ------------------------------------------------------------------ what is refused, and where


@pytest.mark.parametrize("case,key,value", [
    ("olmo2", "hidden_act", "gelu"),
    ("gemma2", "hidden_activation", "gelu"),
    ("gemma2", "use_bidirectional_attention", True),
    ("gemma2", "sliding_window", None),
    ("gemma3", "attn_logit_softcapping", 20.0),
    ("gemma3", "layer_types", "sliding_attention"),
])
def test_hf_settings_lmforge_cannot_build_are_refused(case, key, value):
    hf = CASES[case]().to_dict()
    hf[key] = value
    with pytest.raises(LmforgeError, match=key):
        hf_to_model_config(hf)


def test_gemma3_bad_layer_pattern_is_refused():
    hf = CASES["gemma3"]().to_dict()
    del hf["layer_types"]
    hf["sliding_window_pattern"] = 0
    with pytest.raises(LmforgeError, match="sliding_window_pattern"):
        hf_to_model_config(hf)


def test_gemma3_rope_scaling_on_sliding_layers_is_refused():
    hf = CASES["gemma3"]().to_dict()
    hf["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0}
    with pytest.raises(LmforgeError, match="sliding_attention.rope_type"):
        hf_to_model_config(hf)
    hf["rope_parameters"]["sliding_attention"] = {"rope_type": "default", "rope_theta": 100.0}
    hf["rope_parameters"]["full_attention"] = {"rope_type": "nonesuch", "factor": 2.0, "rope_theta": 1e3}
    with pytest.raises(LmforgeError, match="nonesuch"):
        hf_to_model_config(hf)


def test_gemma3_legacy_rope_keys_read_alike():
    """transformers 4.x's config.json: rope_theta, rope_local_base_freq and rope_scaling (full layers)."""
    new = CASES["gemma3"]().to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=1000.0, rope_local_base_freq=100.0,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    cfg = hf_to_model_config(old)
    assert cfg == hf_to_model_config(new)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.factor) == (1000.0, 100.0, 2.0)


def test_refused_import_exits_2_and_keeps_the_source(tmp_path, capsys):
    from lmforge.cli import main

    config = CASES["gemma2"]()
    hf = transformers.Gemma2ForCausalLM(config)
    hf.save_pretrained(tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw["hidden_activation"] = "gelu"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    before = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "hidden_activation='gelu'" in err and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == before
    assert not (tmp_path / "out").exists()


def test_biases_outside_attention_are_refused_on_export(tmp_path):
    from lmforge.models.transformer import build_model

    for family, kw in (("olmo2", dict(norm_placement="post", qk_norm=True)),
                       ("gemma2", dict(norm_placement="sandwich", norm_weight_offset=1.0, embed_scale=True,
                                       mlp="geglu"))):
        for bias, needle in ((dict(bias=True), "bias=true"), (dict(qkv_bias=True), "attn_out_bias=False")):
            with pytest.raises(LmforgeError, match=needle):
                to_hf(build_model(_cfg(**kw, **bias)), tmp_path / family, model_type=family)


def test_export_as_a_family_without_the_features_is_refused(family, tmp_path):
    name, _, _, ours = family
    for other in ("llama", "gpt2", "mixtral", "gemma2" if name.startswith("olmo2") else "olmo2"):
        with pytest.raises(LmforgeError, match="cannot be exported|exports as"):
            to_hf(ours, tmp_path / other, model_type=other)
        assert not (tmp_path / other).exists()


def test_tensor_parallel_refuses_norms_after_the_sub_layers():
    from lmforge.config.schema import ParallelConfig
    from lmforge.errors import ConfigError
    from lmforge.parallel.dims import ParallelDims

    dims = ParallelDims.resolve(ParallelConfig(tp=2, dp_shard=1), 2)
    dims.check_model(_cfg())
    with pytest.raises(ConfigError, match="norm_placement=sandwich"):
        dims.check_model(_cfg(norm_placement="sandwich"))


# ------------------------------------------------------------------ Gemma's chat template

# Gemma's template as Hub models ship it, in short: no system role, so a system message is folded into
# the first user turn; the assistant is "model"; the bos token comes from the tokenizer config.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{% if role == 'model' %}{% generation %}{{ message['content'] | trim + '<end_of_turn>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] | trim + '<end_of_turn>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass?"},
    {"role": "assistant", "content": " Green. "},
]


@pytest.mark.parametrize("tagged", [True, False], ids=["generation-tags", "prefix-spans"])
def test_gemma_template_renders_and_masks_like_transformers(tmp_path, tagged):
    """lmforge's rendering of a conversation with a system message equals transformers'
    apply_chat_template, and its assistant mask equals return_assistant_tokens_mask, whether the
    template marks the replies ({% generation %}) or lmforge finds them by rendering prefixes."""
    from lmforge.data.chat import Conversation
    from lmforge.data.chat_template import ChatTemplate
    from lmforge.data.sft_examples import label_mask
    from lmforge.data.tokenizer import Tokenizer

    text = " ".join(m["content"] for m in CONVERSATION) + " user model"
    tok = Tokenizer.train([text * 4], 300, 1)
    tok.add_special_tokens(["<bos>", "<start_of_turn>", "<end_of_turn>"])
    tok.save(tmp_path / "tok.json")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok.json"),
                                                  bos_token="<bos>", eos_token="<end_of_turn>")
    tagged_source = GEMMA_TEMPLATE
    source = tagged_source
    if not tagged:
        source = source.replace("{% generation %}", "").replace("{% endgeneration %}", "")
        # By prefixes a reply is all the turn adds, its closing newline too: transformers' mask of a
        # template whose generation block holds that newline.
        tagged_source = tagged_source.replace("{% endgeneration %}{{ '\\n' }}",
                                              "{{ '\\n' }}{% endgeneration %}")
        assert tagged_source != GEMMA_TEMPLATE
    template = ChatTemplate(source, {"bos_token": "<bos>"}, name="gemma-like template")

    want = hf_tok.apply_chat_template(CONVERSATION, tokenize=False, chat_template=source)
    assert template.render(CONVERSATION) == want
    assert want.startswith("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat colour")  # system folded
    prompt = CONVERSATION[:2]
    assert template.render(prompt, add_generation_prompt=True) == hf_tok.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, chat_template=source)

    ours = label_mask(Conversation(tuple(CONVERSATION), "test"), template, tok, "assistant")
    theirs = hf_tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True, chat_template=tagged_source)
    assert ours.ids.tolist() == theirs["input_ids"]
    assert ours.mask.astype(int).tolist() == theirs["assistant_masks"]
    newline = "" if tagged else "\n"
    assert hf_tok.decode(ours.ids[ours.mask]) == f"Blue.<end_of_turn>{newline}Green.<end_of_turn>{newline}"


# ------------------------------------------------------------------ dtype handling and training paths


def test_embedding_scale_is_rounded_to_the_dtype_as_transformers_rounds_it(family):
    """In bfloat16 transformers multiplies by sqrt(d_model) rounded to bfloat16 (5.65625 for d=32), not
    by the float32 value: the embedded inputs are bit-equal."""
    name, _, hf, ours = family
    if not name.startswith("gemma"):
        pytest.skip("OLMo 2 does not scale its embeddings")
    ids = _ids()
    emb = hf.get_input_embeddings()
    with torch.no_grad():
        want = emb.to(torch.bfloat16)(ids)
        got = ours.tok_embeddings.to(torch.bfloat16)(ids) * ours._embed_scales[torch.bfloat16]
        emb.float()
        ours.tok_embeddings.float()
    assert ours._embed_scales[torch.bfloat16] == 5.65625 != ours._embed_scales[torch.float32]
    assert torch.equal(got, want)


def test_sft_with_soft_capped_logits_trains_on_whole_logits(tmp_path):
    """SFT projects only the target rows through head=, which would skip the final soft-cap: a model
    with final_logit_softcap takes the whole-logits path, and its loss is the soft-capped one."""
    from lmforge.data.batch import ChatBatch
    from lmforge.engine.objectives.sft import SFT
    from lmforge.models.transformer import build_model

    torch.manual_seed(0)
    model = build_model(_cfg(final_logit_softcap=0.5))
    objective = SFT(target_rows=True)
    objective.check_model(model)
    assert objective.target_rows is False
    ids = _ids(t=12)
    targets = ids.roll(-1, 1)
    targets[:, :5] = -100
    batch = ChatBatch(input_ids=ids, targets=targets, n_targets=int((targets != -100).sum()))
    loss = objective(model, batch).loss
    want = F.cross_entropy(model(ids).reshape(-1, V), targets.reshape(-1), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)


def test_lora_sft_on_a_gemma_hub_dir_exports_to_peft(tmp_path):
    """The whole path a user takes: `lmforge sft` with LoRA from a Gemma 2 dir (soft-capped logits,
    sliding layers, its own Gemma chat template with a system prompt folded in), `lmforge export
    --adapter`, and transformers + PEFT give our logits."""
    from lmforge.checkpoint.runs import run_config
    from lmforge.cli import main
    from lmforge.data.instruct_tasks import generate, write_jsonl
    from lmforge.data.tokenizer import Tokenizer
    from lmforge.finetune.setup import load_finetuned

    records = generate(None, 40, seed=1, system="Answer briefly.")
    text = " ".join(m["content"] for r in records for m in r["messages"]) + " user model"
    tok = Tokenizer.train([text * 2], 300, 2)
    tok.add_special_tokens(["<bos>", "<start_of_turn>", "<end_of_turn>"])
    tok.save(tmp_path / "tok.json")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok.json"),
                                                  bos_token="<bos>", eos_token="<end_of_turn>",
                                                  pad_token="<end_of_turn>")
    hf_tok.chat_template = GEMMA_TEMPLATE
    shape = {**COMMON, "vocab_size": len(hf_tok), "max_position_embeddings": 128}
    config = transformers.Gemma2Config(**shape, **GEMMA, num_attention_heads=4, num_key_value_heads=2,
                                       attn_logit_softcapping=3.0, final_logit_softcapping=4.0)
    torch.manual_seed(0)
    hf = transformers.Gemma2ForCausalLM(config)
    randomize(hf)
    hf.save_pretrained(tmp_path / "model")
    hf_tok.save_pretrained(tmp_path / "model")
    write_jsonl(records, tmp_path / "chat.jsonl")
    run = tmp_path / "run"
    sets = [f"run.dir={run}", f"model.init_from={tmp_path / 'model'}",
            f"sft.data=[{tmp_path / 'chat.jsonl'}]",
            "train.seq_len=96", "train.max_steps=3", "train.micro_batch_size=4", "train.eval_every=0",
            "train.precision=fp32", "finetune.method=lora", "optim.lr=1e-2", "schedule.warmup_steps=0",
            "logging.progress=none"]
    assert main(["sft", *[a for s in sets for a in ("--set", s)]]) == 0
    assert (run / "data" / "chat_template.jinja").read_text() == GEMMA_TEMPLATE  # the model's own
    out = tmp_path / "export"
    assert main(["export", str(run), str(out), "--adapter"]) == 0
    cfg, ckpt = run_config(run)
    ours, _ = load_finetuned(cfg, ckpt)
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base")
    ref = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    x = torch.tensor([hf_tok.apply_chat_template(records[0]["messages"], tokenize=True, return_dict=True)[
        "input_ids"]])
    with torch.no_grad():
        got = ours.eval()(x)
        torch.testing.assert_close(got, ref(x).logits, rtol=0, atol=ATOL)
        assert (got - hf(x).logits).abs().amax() > 1e-3  # the adapters did train


def test_init_from_checks_the_block_flags(family):
    """model.init_from into a model section whose block flags differ from the checkpoint's is refused,
    naming the flag (the weights would load, into a different model)."""
    from lmforge.models.hf import load_pretrained
    from lmforge.models.transformer import build_model

    name, path, _, ours = family
    same = build_model(ours.cfg)
    load_pretrained(path, same)
    key, value = ("norm_placement", "sandwich") if name.startswith("olmo2") else ("final_logit_softcap", 7.0)
    with pytest.raises(LmforgeError, match=key):
        load_pretrained(path, build_model(ours.cfg.model_copy(update={key: value})))


@pytest.mark.parametrize("model_type,n_layers,extra", [
    ("gemma2", 5, {}), ("gemma3_text", 8, {}), ("gemma3_text", 7, {"sliding_window_pattern": 3}),
])
def test_default_layer_pattern_matches_transformers(model_type, n_layers, extra):
    """A config.json without layer_types: the sliding layers are the ones transformers picks."""
    cls = transformers.Gemma2Config if model_type == "gemma2" else transformers.Gemma3TextConfig
    theirs = cls(**{**COMMON, "num_hidden_layers": n_layers}, **GEMMA, num_attention_heads=4, **extra)
    raw = {k: v for k, v in theirs.to_dict().items() if k not in ("layer_types", "_sliding_window_pattern")}
    assert hf_to_model_config(raw).layer_types == theirs.layer_types
    assert "full_attention" in theirs.layer_types and "sliding_attention" in theirs.layer_types


@pytest.mark.parametrize("scaling", [
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8},
], ids=lambda s: s["rope_type"])
def test_gemma3_scaled_rope_on_full_layers_only(tmp_path, scaling):
    """Gemma 3's other RoPE scalings apply to the full-attention layers alone, as transformers applies
    them (dynamic NTK past its original 16 positions too)."""
    config = transformers.Gemma3TextConfig(
        **{**COMMON, "max_position_embeddings": 16}, **GEMMA, num_attention_heads=4, num_key_value_heads=2,
        rope_theta=1000.0, rope_local_base_freq=100.0, rope_scaling=scaling,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(config).eval()
    randomize(hf)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path).eval()
    assert ours.cfg.rope_scaling.type == scaling["rope_type"] and ours.cfg.rope_local_theta == 100.0
    ids = _ids(t=30 if scaling["rope_type"] == "dynamic" else 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=ATOL)
