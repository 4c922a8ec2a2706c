"""Qwen3, Qwen3-MoE, Granite and SmolLM3 against transformers: tiny random models transformers saved
(odd shapes: head_dim != d_model / heads, GQA ratio 1 and > 1, tied and untied embeddings, biases on
and off) import with equal float32 logits (1e-5), export to a dir transformers loads with equal logits,
greedy generation through our KV cache equals transformers' generate for 16 new tokens, and a LoRA
fine-tune of the imported model loads into PEFT on the original model with equal logits."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from lmforge.errors import LmforgeError
from lmforge.finetune.lora import apply_lora
from lmforge.finetune.peft_io import save_peft_adapter
from lmforge.models import KVCache, Transformer
from lmforge.models.generation import sample_replies
from lmforge.models.hf import from_hf, hf_to_model_config, load_pretrained, to_hf
from lmforge.models.transformer import build_model

transformers = pytest.importorskip("transformers")

V, T, NEW, ATOL = 96, 13, 16, 1e-5
COMMON = dict(vocab_size=V, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=64)
SMALL = dict(COMMON, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
FAMILIES = {
    # GQA 4/2, head_dim 12 != 32/4, untied, no biases, large theta.
    "qwen3": lambda: transformers.Qwen3Config(
        **SMALL, num_key_value_heads=2, head_dim=12, intermediate_size=48, tie_word_embeddings=False,
        rope_theta=1e6),
    # GQA ratio 1, head_dim 16, tied, attention_bias on q/k/v/o, three layers.
    "qwen3_bias_tied": lambda: transformers.Qwen3Config(
        **{**SMALL, "num_hidden_layers": 3}, num_key_value_heads=4, head_dim=16, intermediate_size=40,
        tie_word_embeddings=True, attention_bias=True),
    # A window of 5 < T on every layer (max_window_layers=0), GQA 4/1.
    "qwen3_window": lambda: transformers.Qwen3Config(
        **SMALL, num_key_value_heads=1, head_dim=8, intermediate_size=48, tie_word_embeddings=False,
        use_sliding_window=True, sliding_window=5, max_window_layers=0),
    # YaRN past an original context of 8 positions (the tests run longer sequences).
    "qwen3_yarn": lambda: transformers.Qwen3Config(
        **SMALL, num_key_value_heads=2, head_dim=12, intermediate_size=48, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                         "original_max_position_embeddings": 8}),
    # Experts of width 24 (dense width 40 unused), renormalised top-2 of 5, attention biases, head_dim 12.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, num_key_value_heads=2, head_dim=12, intermediate_size=40, moe_intermediate_size=24,
        num_experts=5, num_experts_per_tok=2, norm_topk_prob=True, attention_bias=True,
        tie_word_embeddings=False),
    # Unnormalised top-2 of 4, GQA ratio 1, head_dim from the sizes, tied.
    "qwen3_moe_tied": lambda: transformers.Qwen3MoeConfig(
        **SMALL, num_key_value_heads=4, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=True),
    # Every multiplier away from 1, biases everywhere, GQA 4/2, head_dim 12, untied.
    "granite": lambda: transformers.GraniteConfig(
        **SMALL, num_key_value_heads=2, head_dim=12, intermediate_size=48, attention_bias=True, mlp_bias=True,
        embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.15, logits_scaling=2.5,
        tie_word_embeddings=False),
    # Granite's default attention_multiplier (1.0: no 1/sqrt(head_dim)), tied, GQA ratio 1.
    "granite_tied": lambda: transformers.GraniteConfig(
        **SMALL, num_key_value_heads=4, intermediate_size=40, embedding_multiplier=0.5, logits_scaling=0.8,
        tie_word_embeddings=True),
    # NoPE every 2nd layer of 3 (no_rope_layer_interval), tied (SmolLM3's default), GQA 4/2, head_dim 12.
    "smollm3": lambda: transformers.SmolLM3Config(
        **{**SMALL, "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=12, intermediate_size=48,
        no_rope_layer_interval=2),
    # An explicit no_rope_layers list (layer 0 NoPE), biases everywhere, untied, GQA ratio 1.
    "smollm3_explicit": lambda: transformers.SmolLM3Config(
        **SMALL, num_key_value_heads=4, intermediate_size=40, no_rope_layers=[0, 1], attention_bias=True,
        mlp_bias=True, tie_word_embeddings=False),
}
CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "granite": "GraniteForCausalLM",
           "smollm3": "SmolLM3ForCausalLM"}


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights and biases everywhere, norms around 1 (HF's 1 and 0 would hide mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, its saved dir, our import)."""
    torch.manual_seed(0)
    config = FAMILIES[request.param]()
    config._attn_implementation = "sdpa"
    hf = getattr(transformers, CLASSES[config.model_type])(config).eval()
    randomize(hf)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path, from_hf(path).eval()


def ids(seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, V, (batch, T), generator=torch.Generator().manual_seed(seed))


def test_import_gives_equal_logits(family):
    name, hf, _, ours = family
    with torch.no_grad():
        ref = hf(ids()).logits
        assert ref.abs().amax() > 0.5  # large enough for 1e-5 to be a real check
        torch.testing.assert_close(ours(ids()), ref, atol=ATOL, rtol=0)
    cfg = ours.cfg
    assert cfg.resolved_head_dim == hf.model.layers[0].self_attn.head_dim
    assert cfg.tie_embeddings == hf.config.tie_word_embeddings
    if name.startswith("qwen3"):
        assert cfg.qk_norm and cfg.qk_norm_scope == "head"
    if name == "smollm3":
        assert cfg.nope_layers == [1]  # (i + 1) % 2 == 0


def test_export_loads_in_transformers_with_equal_logits(family, tmp_path):
    name, hf, _, ours = family
    to_hf(ours, tmp_path, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == hf.config.model_type
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        torch.testing.assert_close(back(ids(1)).logits, hf(ids(1)).logits, atol=ATOL, rtol=0)
    # The export reads back as the same config, and loads into a model built from it (init_from).
    assert hf_to_model_config(written) == ours.cfg
    again = build_model(ours.cfg)
    load_pretrained(tmp_path, again)
    theirs = again.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in ours.state_dict().items())
    # A model section whose flags differ from the checkpoint's is refused, naming the flag.
    for flag, value in (("logits_scaling", 7.0), ("nope_layers", [0, 1]), ("qk_norm_scope", "all")):
        other = ours.cfg.model_copy(update={flag: value, "qk_norm": True})
        if getattr(other, flag) != getattr(ours.cfg, flag):
            with pytest.raises(LmforgeError, match=flag):
                load_pretrained(tmp_path, build_model(other))


def greedy(model: Transformer, x: torch.Tensor, mask: torch.Tensor, steps: int):
    """Greedy decoding through our KV cache with generate's padding conventions (positions
    cumsum(mask) - 1): the new tokens (B, steps) and the logits that chose them (steps, B, V)."""
    cache = KVCache(model, x.shape[0], x.shape[1] + steps)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(x, cache=cache, attention_mask=mask, position_ids=pos)[:, -1]
    out, scores = [], []
    for _ in range(steps):
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        scores.append(logits)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        pos = pos[:, -1:] + 1
        logits = model(nxt, cache=cache, attention_mask=mask, position_ids=pos)[:, -1]
    return torch.cat(out, dim=1), torch.stack(scores)


def test_greedy_generation_matches_transformers_generate(family):
    name, hf, _, ours = family
    x = ids(2)[:, :7]
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # a left-padded second prompt
    x = x.masked_fill(mask == 0, 0)
    with torch.no_grad():
        ref = hf.generate(x, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=0,
                          eos_token_id=None, return_dict_in_generate=True, output_logits=True)
        got, logits = greedy(ours, x, mask, NEW)
    assert torch.equal(got, ref.sequences[:, x.shape[1]:])
    # Tiny random models often repeat a token: the logits of every step are the sharper check.
    torch.testing.assert_close(logits, torch.stack(ref.logits), atol=ATOL, rtol=0)
    # The sampler the CLI verbs use (left-padded batch, KV cache) gives the same tokens.
    prompts = [x[0].tolist(), x[1, 3:].tolist()]
    assert sample_replies(ours, prompts, NEW, stops=set()) == ref.sequences[:, x.shape[1]:].tolist()


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# One configuration per family keeps the file fast; the experts of an MoE are no linear layers: its
# adapters go on the attention.
LORA_FAMILIES = ("qwen3_bias_tied", "qwen3_moe", "granite", "smollm3_explicit")


def test_lora_fine_tune_loads_into_peft_on_the_original_model(family, tmp_path):
    peft = pytest.importorskip("peft")
    name, hf, path, _ = family
    if name not in LORA_FAMILIES:
        pytest.skip("one configuration per family fine-tunes")
    ours = from_hf(path)
    apply_lora(ours, LORA_TARGETS[:4] if ours.cfg.moe else LORA_TARGETS, r=4, alpha=8, init="seeded", seed=3)
    opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-2)
    before = ours(ids(4)).detach()
    for step in range(3):  # a few steps of next-token training on random rows
        x = ids(5 + step, batch=4)
        loss = F.cross_entropy(ours(x)[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    ours.eval()
    save_peft_adapter(ours, tmp_path, str(path), ours.cfg)
    base = transformers.AutoModelForCausalLM.from_pretrained(path)
    ref = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    with torch.no_grad():
        got = ours(ids(4))
        assert (got - before).abs().amax() > 1e-2  # training moved the adapters
        torch.testing.assert_close(got, ref(input_ids=ids(4)).logits, atol=ATOL, rtol=0)


def hf_dict(name: str, **over) -> dict:
    return {**FAMILIES[name]().to_dict(), **over}


@pytest.mark.parametrize("name,over,needle", [
    # A window on layers >= 1 only: some layers slide, some do not.
    ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1, layer_types=None),
     "use_sliding_window/max_window_layers"),
    ("qwen3", dict(rope_parameters={"rope_type": "nonesuch", "factor": 2.0, "rope_theta": 1e4}), "nonesuch"),
    ("qwen3", dict(hidden_act="gelu"), "hidden_act"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step"),
    ("granite", dict(attention_bias=True, mlp_bias=False), "attention_bias/mlp_bias"),
    ("smollm3", dict(no_rope_layers=[1, 0]), "no_rope_layers"),
    ("smollm3", dict(no_rope_layers=None, no_rope_layer_interval=0), "no_rope_layer_interval"),
    # transformers' default: the window on the NoPE layers only.
    ("smollm3", dict(use_sliding_window=True, sliding_window=4, layer_types=None), "use_sliding_window"),
])
def test_settings_lmforge_cannot_build_are_refused_naming_the_key(name, over, needle):
    with pytest.raises(LmforgeError, match=needle):
        hf_to_model_config(hf_dict(name, **over))


def test_config_json_defaults_are_transformers_class_defaults():
    """Keys a config.json leaves out take the values transformers' config class gives them."""
    minimal = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=32,
                   intermediate_size=48)
    qwen3 = hf_to_model_config({**minimal, "model_type": "qwen3"})
    assert (qwen3.resolved_head_dim, qwen3.resolved_kv_heads, qwen3.tie_embeddings) == (128, 32, False)
    smol = hf_to_model_config({**minimal, "model_type": "smollm3"})
    assert smol.nope_layers == [3] and smol.rope_theta == 2e6 and smol.tie_embeddings
    assert smol.resolved_kv_heads == 4
    granite = hf_to_model_config({**minimal, "model_type": "granite"})
    assert granite.attention_multiplier == 1.0 and granite.logits_scaling == 1.0
    assert granite.resolved_kv_heads == 32 and not granite.tie_embeddings
    for cfg, model_type in ((qwen3, "qwen3"), (smol, "smollm3"), (granite, "granite")):
        config = getattr(transformers, f"{CLASSES[model_type].removesuffix('ForCausalLM')}Config")(
            **minimal, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        hf = getattr(transformers, CLASSES[model_type])(config)
        assert hf.model.layers[0].self_attn.head_dim == cfg.resolved_head_dim


@pytest.mark.parametrize("name,model_type,needle", [
    ("qwen3", "llama", "qk_norm_scope='head'"),
    ("qwen3", "qwen2", "qk_norm"),
    ("granite", "llama", "embedding_multiplier=3.0"),
    ("granite", "qwen3", "Qwen3 has no such setting"),
    ("smollm3", "llama", "nope_layers=\\[1\\]"),
    ("smollm3", "granite", "nope_layers"),
    ("qwen3_moe", "olmoe", "qk_norm_scope"),
])
def test_export_as_a_family_that_would_drop_a_setting_is_refused(name, model_type, needle, tmp_path):
    cfg = hf_to_model_config(hf_dict(name))
    with pytest.raises(LmforgeError, match=needle):
        to_hf(build_model(cfg), tmp_path, model_type=model_type)
    assert not any(tmp_path.iterdir())  # nothing written


def test_cli_import_refuses_what_it_cannot_build_in_one_line(tmp_path, capsys):
    from lmforge.cli import main

    src = tmp_path / "src"
    transformers.Qwen3MoeForCausalLM(FAMILIES["qwen3_moe"]()).save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [0]}))
    capsys.readouterr()  # transformers' own progress output
    assert main(["import", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmforge import: error:") and "mlp_only_layers=[0]" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_cli_lora_sft_on_qwen3_exports_an_adapter_peft_loads(tmp_path):
    """`lmforge sft` with LoRA on a Hub-style Qwen3 dir (model.init_from, its own chat template), then
    `lmforge export --adapter`: PEFT on the exported base gives our logits."""
    peft = pytest.importorskip("peft")
    from lmforge.checkpoint.runs import run_config
    from lmforge.cli import main
    from lmforge.data.instruct_tasks import generate, write_jsonl
    from lmforge.data.tokenizer import Tokenizer
    from lmforge.finetune.setup import load_finetuned

    records = generate(None, 40, seed=1)
    text = " ".join(m["content"] for r in records for m in r["messages"])
    tok = Tokenizer.train([text * 2], 300, 2)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(tmp_path / "tok.json")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok.json"),
                                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf_tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    config = FAMILIES["qwen3_bias_tied"]()
    config.vocab_size, config.max_position_embeddings = len(hf_tok), 128
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(config)
    randomize(hf)
    hf.save_pretrained(tmp_path / "model")
    hf_tok.save_pretrained(tmp_path / "model")
    write_jsonl(records, tmp_path / "chat.jsonl")
    run = tmp_path / "run"
    sets = [f"run.dir={run}", f"model.init_from={tmp_path / 'model'}",
            f"sft.data=[{tmp_path / 'chat.jsonl'}]", "train.seq_len=96", "train.max_steps=3",
            "train.micro_batch_size=4", "train.eval_every=0", "train.precision=fp32", "finetune.method=lora",
            "optim.lr=1e-2", "schedule.warmup_steps=0", "logging.progress=none"]
    assert main(["sft", *[a for s in sets for a in ("--set", s)]]) == 0
    out = tmp_path / "export"
    assert main(["export", str(run), str(out), "--adapter"]) == 0
    assert json.loads((out / "base" / "config.json").read_text())["model_type"] == "qwen3"
    ours, _ = load_finetuned(*run_config(run))
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base")
    ref = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    x = ids(6)
    with torch.no_grad():
        got = ours.eval()(x)
        assert (got - hf(x).logits).abs().amax() > 1e-3  # the adapters trained
        torch.testing.assert_close(got, ref(input_ids=x).logits, atol=ATOL, rtol=0)
