"""gpt-oss against transformers: tiny random GptOssForCausalLM models (transformers' default alternation of
sliding-window and full layers with T past the window, and every layer full; default RoPE, and YaRN past
its original context) import with equal float32 logits (1e-5),
also left-padded; export to a dir transformers loads with equal logits; greedy generation through our KV
cache equals transformers' generate; the router's balance loss equals transformers'. The two block flags
are checked on their own: attention sinks (a sink of -inf is plain attention; packed rows attend as
separate sequences) and the clamped SwiGLU against transformers' own gate function."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.config.schema import ModelConfig, MoEConfig
from lmforge.errors import LmforgeError
from lmforge.models.generation import sample_replies
from lmforge.models.hf import from_hf, hf_to_model_config, load_pretrained, to_hf
from lmforge.models.moe import clamped_glu, moe_layers, router_losses
from lmforge.models.transformer import Transformer, build_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

V, T, ATOL = 96, 16, 1e-5
BASE = dict(vocab_size=V, max_position_embeddings=64, pad_token_id=0, bos_token_id=None, eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
CASES = {
    # GQA 4:2, head_dim 12 != 32 / 4, untied head, q/k/v/o biases, a clamp that binds (limit 0.5);
    # layer_types left to transformers' default (sliding, full), a window of 5 < T.
    "gqa_untied_bias": dict(layer_types=None, sliding_window=5,
                            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=12, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                            tie_word_embeddings=False, attention_bias=True, swiglu_limit=0.5),
    # No GQA (5:5), head_dim 8 = 40 / 5, tied embeddings, no attention biases, top-3 of 5, other alpha;
    # every layer full attention;
    # YaRN as the released models have it (truncate false), T = 16 past its original 8 positions.
    "mha_tied_nobias": dict(hidden_size=40, num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=5,
                            head_dim=8, intermediate_size=20, num_local_experts=5, num_experts_per_tok=3,
                            tie_word_embeddings=True, attention_bias=False, swiglu_alpha=1.3,
                            swiglu_limit=1.0,
                            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                             "original_max_position_embeddings": 8}),
}


def hf_config(name: str, **over):
    kw = {**BASE, **CASES[name], **over}
    if "layer_types" not in kw:
        kw["layer_types"] = ["full_attention"] * kw["num_hidden_layers"]
    return transformers.GptOssConfig(**kw)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights everywhere, norms around 1, sinks of order 1 (HF's init hides bias and sink bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else noise if "sinks" in name else 0.3 * noise)


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(hf_config(request.param)).eval()
    randomize(model)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path, model


def _ids(seed: int = 0, n: int = 2, t: int = T) -> torch.Tensor:
    return torch.randint(3, V, (n, t), generator=torch.Generator().manual_seed(seed))


def test_import_gives_equal_logits(hf_dir):
    path, hf = hf_dir
    ours = from_hf(path).eval()
    cfg = ours.cfg
    assert cfg.attn_sinks and cfg.moe.router_bias and cfg.moe.experts_bias
    assert (cfg.moe.expert_act, cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit) == (
        "clamped_swiglu", hf.config.swiglu_alpha, hf.config.swiglu_limit)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=ATOL)
        # Left padding: padding keys masked in both; the real positions' logits agree.
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        theirs = hf(ids, attention_mask=mask, position_ids=pos).logits
        mine = ours(ids, attention_mask=mask, position_ids=pos)
        torch.testing.assert_close(mine[mask.bool()], theirs[mask.bool()], rtol=0, atol=ATOL)


def test_export_loads_in_transformers_with_equal_logits(hf_dir, tmp_path):
    path, hf = hf_dir
    ours = from_hf(path).eval()
    out = tmp_path / "export"
    to_hf(ours, out)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gpt_oss" and written["swiglu_limit"] == hf.config.swiglu_limit
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "GptOssForCausalLM"
    ids = _ids(1)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, rtol=0, atol=ATOL)
    # The export re-imports to the same parameters, and loads into a model built from the same config.
    again = from_hf(out)
    model = build_model(ours.cfg)
    load_pretrained(out, model)
    for k, a in ours.state_dict().items():
        assert torch.equal(a, again.state_dict()[k]) and torch.equal(a, model.state_dict()[k]), k
    other = ours.cfg.model_copy(update={"moe": ours.cfg.moe.model_copy(update={"swiglu_limit": 3.0})})
    with pytest.raises(LmforgeError, match="moe: model"):
        load_pretrained(out, build_model(other))


def test_greedy_generation_equals_transformers(hf_dir):
    path, hf = hf_dir
    ours = from_hf(path)
    prompts = [_ids(2, 1, 7)[0].tolist(), _ids(3, 1, 4)[0].tolist()]  # left-padded together in ours
    replies = sample_replies(ours, prompts, 16, set())
    for prompt, reply in zip(prompts, replies):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16,
                                 min_new_tokens=16)
        assert reply == theirs[0, len(prompt):].tolist()


def test_balance_loss_equals_transformers(hf_dir):
    path, hf = hf_dir
    ours = from_hf(path).train()
    ids = _ids(4)
    hf.train()
    try:
        out = hf(ids, labels=ids, output_router_logits=True)
    finally:
        hf.eval()
    ours(ids)
    mine = router_losses(moe_layers(ours))
    assert mine.metrics["moe_aux_loss"].item() == pytest.approx(out.aux_loss.item(), rel=1e-5)
    assert ours.cfg.moe.aux_loss_coef == hf.config.router_aux_loss_coef


# ------------------------------------------------------------------------------- the flags alone


def _sink_pair(**over) -> tuple[Transformer, Transformer]:
    """The same weights with and without attention sinks (sinks -inf: no weight, plain attention)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, d_ff=40,
                      max_seq_len=64, bias=True, **over)
    plain = build_model(cfg).eval()
    sinks = build_model(cfg.model_copy(update={"attn_sinks": True})).eval()
    missing = sinks.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["layers.0.attn.sinks", "layers.1.attn.sinks"]
    return plain, sinks


@pytest.mark.parametrize("over", [{}, {"attention_multiplier": 0.3}], ids=["sdpa_scale", "own_scale"])
def test_sinks_off_is_plain_attention_and_minus_inf_sinks_equal_it(over):
    plain, sinks = _sink_pair(**over)
    assert not any("sinks" in n for n, _ in plain.named_parameters())
    with torch.no_grad():
        for layer in sinks.layers:
            layer.attn.sinks.fill_(float("-inf"))
        ids = _ids(5)
        torch.testing.assert_close(sinks(ids), plain(ids), rtol=0, atol=ATOL)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        torch.testing.assert_close(sinks(ids, attention_mask=mask)[mask.bool()],
                                   plain(ids, attention_mask=mask)[mask.bool()], rtol=0, atol=ATOL)
        # Finite sinks take weight: the outputs move.
        for layer in sinks.layers:
            layer.attn.sinks.fill_(1.0)
        assert (sinks(ids) - plain(ids)).abs().max() > 1e-3


def test_sinks_with_cache_and_packed_rows_equal_whole_sequences():
    from lmforge.models.common.attention import KVCache

    _, model = _sink_pair()
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            layer.attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4) + i)
        a, b = _ids(6, 1, 9), _ids(7, 1, 7)
        whole_a, whole_b = model(a), model(b)
        # Decoding token by token after a prefill gives the full forward's logits.
        cache = KVCache(model, 1, 16)
        steps = [model(a[:, :5], cache=cache)] + [model(a[:, t:t + 1], cache=cache) for t in range(5, 9)]
        torch.testing.assert_close(torch.cat(steps, 1), whole_a, rtol=0, atol=ATOL)
        # Two documents packed in one row attend only within themselves (the dense-mask path: no flex).
        packed = torch.cat([a, b], 1)
        seg = torch.tensor([[0] * 9 + [1] * 7])
        pos = torch.cat([torch.arange(9), torch.arange(7)])[None]
        out = model(packed, segment_ids=seg, position_ids=pos)
        torch.testing.assert_close(out, torch.cat([whole_a, whole_b], 1), rtol=0, atol=ATOL)


def test_clamped_glu_equals_transformers_gate():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(hf_config("gqa_untied_bias", swiglu_alpha=1.5, swiglu_limit=2.0))
    gate_up = torch.linspace(-6, 6, 2 * 7 * 24).reshape(7, 48)  # beyond the limit on both sides
    ours = clamped_glu(gate_up[:, 0::2], gate_up[:, 1::2], 1.5, 2.0)
    torch.testing.assert_close(ours, experts._apply_gate(gate_up), rtol=0, atol=0)


def test_moe_flags_off_add_no_parameters():
    cfg = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, d_ff=24,
                      moe=MoEConfig(n_experts=2, top_k=1))
    names = {n for n, _ in build_model(cfg).named_parameters()}
    assert not any(n.endswith(("router.gate.bias", "b_gate", "b_up", "b_down")) for n in names)
    flags = MoEConfig(n_experts=2, top_k=1, router_bias=True, experts_bias=True)
    extra = {n for n, _ in build_model(cfg.model_copy(update={"moe": flags})).named_parameters()} - names
    assert extra == {"layers.0.moe.router.gate.bias", "layers.0.moe.experts.b_gate",
                     "layers.0.moe.experts.b_up", "layers.0.moe.experts.b_down"}


# ------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("over,needle", [
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),  # one entry for two layers
    ({"sliding_window": None}, "sliding_window"),  # sliding layers need a window
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
])
def test_config_settings_lmforge_cannot_build_are_refused(over, needle):
    hf = hf_config("gqa_untied_bias").to_dict()
    hf.update(over)
    with pytest.raises(LmforgeError, match=needle):
        hf_to_model_config(hf)


def test_absent_and_null_keys_read_as_transformers_reads_them():
    hf = hf_config("gqa_untied_bias").to_dict()
    for key in ("num_key_value_heads", "head_dim"):
        del hf[key]
    hf["num_attention_heads"] = 16  # a multiple of the default 8 kv heads
    cfg = hf_to_model_config(hf)
    assert (cfg.resolved_kv_heads, cfg.resolved_head_dim) == (8, 64)  # GptOssConfig's class defaults
    # transformers 4.x wrote null for "derive it" (5.x's strict config refuses null): n_heads, d / n_heads.
    hf.update(num_key_value_heads=None, head_dim=None)
    cfg = hf_to_model_config(hf)
    assert (cfg.resolved_kv_heads, cfg.resolved_head_dim) == (16, 32 // 16)


def test_config_without_rope_parameters_is_transformers_default_yarn():
    hf = hf_config("gqa_untied_bias").to_dict()
    del hf["rope_parameters"]
    cfg = hf_to_model_config(hf)
    sc = cfg.rope_scaling
    assert cfg.rope_theta == 150000.0
    got = (sc.type, sc.factor, sc.original_max_position_embeddings, sc.beta_fast, sc.beta_slow, sc.truncate)
    assert got == ("yarn", 32.0, 4096, 32.0, 1.0, False)


def test_import_cli_takes_the_released_layout_and_refuses_with_exit_2(tmp_path, capsys):
    """transformers' defaults (alternating sliding / full layers, YaRN) import; a setting lmforge cannot
    build is one error line and exit status 2, and nothing is written."""
    from lmforge.cli import main

    shape = {k: v for k, v in CASES["gqa_untied_bias"].items() if k not in ("layer_types", "sliding_window")}
    released = transformers.GptOssConfig(**shape, vocab_size=V)
    assert "sliding_attention" in released.layer_types and released.rope_parameters["rope_type"] == "yarn"
    transformers.GptOssForCausalLM(released).save_pretrained(tmp_path / "released")
    assert main(["import", str(tmp_path / "released"), str(tmp_path / "ok")]) == 0
    cfg = hf_to_model_config(released.to_dict())
    assert (cfg.layer_types, cfg.sliding_window, cfg.rope_scaling.type) == (released.layer_types, 128, "yarn")
    transformers.GptOssForCausalLM(transformers.GptOssConfig(**shape, vocab_size=V, attention_dropout=0.1)
                                   ).save_pretrained(tmp_path / "src")
    capsys.readouterr()
    assert main(["import", str(tmp_path / "src"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "lmforge import: error:" in err and "attention_dropout" in err
    assert not (tmp_path / "out").exists()


def test_invalid_flag_combinations_and_foreign_exports_are_refused(tmp_path):
    with pytest.raises(ValueError, match="clamped_swiglu needs both"):
        MoEConfig(expert_act="clamped_swiglu", swiglu_alpha=1.7)
    with pytest.raises(ValueError, match="swiglu uses neither"):
        MoEConfig(swiglu_limit=7.0)
    with pytest.raises(ValueError, match="attn_sinks"):
        ModelConfig(arch="encoder", pos_embedding="learned", attn_sinks=True)
    with pytest.raises(ValueError, match="does not soft-cap"):
        ModelConfig(attn_sinks=True, attn_logit_softcap=50.0)
    cfg = hf_to_model_config(hf_config("gqa_untied_bias").to_dict())
    for model_type in ("mixtral", "llama"):
        with pytest.raises(LmforgeError, match="attn_sinks.*only gpt_oss"):
            to_hf(build_model(cfg), tmp_path / model_type, model_type=model_type)
    plain = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, d_ff=24,
                        moe=MoEConfig(n_experts=2, top_k=1))
    with pytest.raises(LmforgeError, match="attn_sinks=false"):
        to_hf(build_model(plain), tmp_path / "plain", model_type="gpt_oss")
    assert not (tmp_path / "plain").exists() or not any((tmp_path / "plain").iterdir())


def test_tensor_parallel_would_split_the_heads_from_their_sinks_and_is_refused():
    """(Expert parallelism splits gpt-oss's experts with their biases:
    tests/distributed/test_family_gpt_oss_ep.py.)"""
    from lmforge.config.schema import ParallelConfig
    from lmforge.errors import ConfigError
    from lmforge.parallel.dims import ParallelDims

    cfg = hf_to_model_config(hf_config("gqa_untied_bias").to_dict())
    no_moe = cfg.model_copy(update={"moe": None})  # tp refuses any MoE first: the sinks alone
    with pytest.raises(ConfigError, match="attn_sinks"):
        ParallelDims.resolve(ParallelConfig(tp=2), world_size=2, model=no_moe)
    ParallelDims.resolve(ParallelConfig(dp_replicate=2, ep=2), world_size=2, model=cfg)


# ------------------------------------------------------------------------------------ fine-tuning

# ChatML without generation tags, as a Hub model ships it (the assistant tokens found by prefixes).
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """A tiny random gpt-oss with its own tokenizer and chat template, and chat records to tune it on."""
    from lmforge.data.instruct_tasks import generate, write_jsonl
    from lmforge.data.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("chat")
    records = generate(None, 64, seed=1)
    tok = Tokenizer.train([" ".join(m["content"] for r in records for m in r["messages"]) * 2], 300, 2)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(root / "tok.json")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "tok.json"),
                                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf_tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(hf_config("gqa_untied_bias", vocab_size=len(hf_tok),
                                                     max_position_embeddings=128))
    randomize(model, seed=3)
    model.save_pretrained(root / "model")
    hf_tok.save_pretrained(root / "model")
    write_jsonl(records, root / "chat.jsonl")
    return root


def test_lora_sft_on_attention_exports_to_peft_with_equal_logits(chat_model_dir, tmp_path):
    from lmforge.checkpoint.runs import run_config
    from lmforge.cli import main
    from lmforge.finetune.setup import load_finetuned

    run = tmp_path / "lora"
    sets = [f"run.dir={run}", f"model.init_from={chat_model_dir / 'model'}",
            f"sft.data=[{chat_model_dir / 'chat.jsonl'}]", "train.seq_len=64", "train.max_steps=2",
            "train.micro_batch_size=4", "train.eval_every=0", "train.precision=fp32", "finetune.method=lora",
            "finetune.targets=[q_proj,k_proj,v_proj,o_proj]", "optim.lr=1e-2", "schedule.warmup_steps=0",
            "logging.progress=none"]
    assert main(["sft", *[a for s in sets for a in ("--set", s)]]) == 0
    cfg, ckpt = run_config(run)
    ours, _ = load_finetuned(cfg, ckpt)
    out = tmp_path / "adapter_out"
    assert main(["export", str(run), str(out), "--adapter"]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base")
    ref = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    x = _ids(8, 2, 24)
    with torch.no_grad():
        tuned = ours(x)
        torch.testing.assert_close(tuned, ref(x).logits, rtol=0, atol=ATOL)
        # The adapters moved the model: the base alone differs.
        with ref.disable_adapter():
            assert (ref(x).logits - tuned).abs().max() > 1e-4


def test_lora_on_experts_is_refused_naming_the_targetable_layers(hf_dir, tmp_path):
    from lmforge.errors import ConfigError
    from lmforge.finetune.lora import apply_lora, lora_layers
    from lmforge.finetune.peft_io import save_peft_adapter

    model = from_hf(hf_dir[0])
    for target in ("gate_up_proj", "experts"):
        with pytest.raises(ConfigError, match=r"layers\.\{i\}\.attn\.wq.*layers\.\{i\}\.moe\.router\.gate"):
            apply_lora(model, [target])
    apply_lora(model, "all-linear")  # leaves the router out, as PEFT's all-linear does
    assert not [n for n in lora_layers(model) if "router" in n]
    save_peft_adapter(model, tmp_path / "all-linear", None, model.cfg)
    model = from_hf(hf_dir[0])
    apply_lora(model, ["*router*"])  # an adapter put on the router explicitly has no PEFT name
    with pytest.raises(LmforgeError, match="moe.router.gate has no Hugging Face name"):
        save_peft_adapter(model, tmp_path / "adapter", None, model.cfg)
