"""Phi-3 / Phi-4 (model_type phi3) against transformers on tiny random models it saved: import with
equal float32 logits (1e-5), export that transformers loads with equal logits (fused qkv_proj and
gate_up_proj), greedy generation through our KV cache equal to transformers' generate, including a
longrope model whose generation crosses original_max_position_embeddings, and refusals by name."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from lmforge.config.schema import RopeScalingConfig
from lmforge.errors import LmforgeError
from lmforge.eval import generate as eval_generate
from lmforge.models import KVCache, generation
from lmforge.models.hf import from_hf, hf_to_model_config, model_config_to_hf, to_hf

transformers = pytest.importorskip("transformers")

V, ATOL, NEW = 96, 1e-5, 16
COMMON = dict(vocab_size=V, bos_token_id=1, eos_token_id=2, pad_token_id=0)
ORIGINAL = 24
FAMILIES = {
    # GQA 4/2, half of each head rotated, untied.
    "gqa_partial": lambda: transformers.Phi3Config(
        **COMMON, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, partial_rotary_factor=0.5, rope_theta=5000.0,
        tie_word_embeddings=False),
    # MHA (GQA ratio 1), head_dim 12 != 48/6, tied, a sliding window shorter than the sequences.
    "head_dim_window_tied": lambda: transformers.Phi3Config(
        **COMMON, hidden_size=48, intermediate_size=40, num_hidden_layers=3, num_attention_heads=6,
        head_dim=12, max_position_embeddings=64, sliding_window=7, tie_word_embeddings=True),
    # Phi-4-mini style: longrope with three quarters of each head rotated, tied, GQA 4/1.
    "longrope": lambda: transformers.Phi3Config(
        **COMMON, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=96, original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=0.75, tie_word_embeddings=True,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                      "long_factor": [1.5 + 0.8 * i for i in range(6)]}),
}


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights everywhere, norms around 1 (HF inits norms to 1, which would hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)


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


@pytest.fixture(scope="module", params=list(FAMILIES))
def phi3(request, tmp_path_factory):
    """(name, HF Phi3ForCausalLM, its save_pretrained dir, our import)."""
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(FAMILIES[request.param]()).float().eval()
    randomize(hf)
    hf.generation_config.eos_token_id = None  # generate exactly NEW tokens
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path, from_hf(path).eval()


def _ids(T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, V, (2, T), generator=torch.Generator().manual_seed(seed))


def test_import_gives_equal_logits(phi3):
    name, hf, _, ours = phi3
    lengths = (16, 40) if name == "longrope" else (20,)  # longrope: the short and the long factors
    with torch.no_grad():
        for T in lengths:
            torch.testing.assert_close(ours(_ids(T)), hf(_ids(T)).logits, rtol=0, atol=ATOL)


def test_config_maps_onto_our_flags(phi3):
    name, hf, _, ours = phi3
    cfg = ours.cfg
    assert cfg.rotary_dim == int(cfg.resolved_head_dim * hf.config.rope_parameters["partial_rotary_factor"])
    if name == "longrope":
        sc = cfg.rope_scaling
        assert (sc.type, sc.original_max_position_embeddings, sc.factor) == ("longrope", ORIGINAL, 4.0)
    if name == "head_dim_window_tied":
        assert (cfg.sliding_window, cfg.resolved_head_dim, cfg.tie_embeddings) == (7, 12, True)


def test_export_loads_in_transformers_with_equal_logits(phi3, tmp_path):
    name, hf, _, ours = phi3
    to_hf(ours, tmp_path)  # phi3 by default: the import recorded its hf_model_type
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "phi3"
    with HFLog() as log:
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    assert not log.messages, log.messages
    assert type(back).__name__ == "Phi3ForCausalLM"
    ref_sd = hf.state_dict()
    for key, value in back.state_dict().items():  # the fused tensors concatenated back exactly
        assert torch.equal(value, ref_sd[key]), key
    with torch.no_grad():
        torch.testing.assert_close(back(_ids(40)).logits, hf(_ids(40)).logits, rtol=0, atol=0)
    assert from_hf(tmp_path).cfg == ours.cfg


def test_greedy_generation_equals_transformers_generate(phi3, monkeypatch):
    """16 new tokens; the longrope prompt (12 tokens) grows past original_max_position_embeddings (24),
    where transformers' Phi-3 recomputes the cache with the long factors, and so do we."""
    name, hf, _, ours = phi3
    prompt = torch.randint(3, V, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf.generate(prompt, do_sample=False, max_new_tokens=NEW, pad_token_id=0,
                          return_dict_in_generate=True, output_logits=True)
    # Tiny random models often repeat a token: the logits of every step, as each of our generation
    # loops hands them to its sampler, are the sharper check.
    for module in (generation, eval_generate):  # sample_replies, and `lmforge generate`'s loop
        seen, sample = [], module.sample_next

        def spy(logits, *args, seen=seen, sample=sample, **kwargs):
            seen.append(logits)
            return sample(logits, *args, **kwargs)

        monkeypatch.setattr(module, "sample_next", spy, raising=True)
        if module is generation:
            got = generation.sample_replies(ours, [prompt[0].tolist()], NEW, frozenset(), temperature=0.0)
        else:
            got = eval_generate.generate(ours, prompt[0].tolist(), NEW, temperature=0.0)
        assert got[0] == ref.sequences[0, 12:].tolist()
        torch.testing.assert_close(torch.cat(seen), torch.cat(ref.logits), rtol=0, atol=ATOL)


def test_longrope_cache_is_recomputed_where_the_factors_switch(phi3):
    """Without the recompute, keys cached with the short factors meet queries rotated with the long
    ones: the step that crosses the original length gives other logits than a fresh forward."""
    name, hf, _, ours = phi3
    if name != "longrope":
        pytest.skip("longrope only")
    seq = torch.randint(3, V, (1, ORIGINAL + 1), generator=torch.Generator().manual_seed(8))
    cache = KVCache(ours, 1, ORIGINAL + 1)
    with torch.no_grad():
        ours(seq[:, :ORIGINAL], cache=cache)
        stale = ours(seq[:, ORIGINAL:], cache=cache)[0, -1]
        fresh = ours(seq)[0, -1]
        assert not torch.allclose(stale, fresh, atol=1e-3)  # so the generation test above can fail
        torch.testing.assert_close(fresh, hf(seq).logits[0, -1], rtol=0, atol=ATOL)


def _phi3(**change) -> dict:
    return {**FAMILIES["gqa_partial"]().to_dict(), **change}


@pytest.mark.parametrize("change, match", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"resid_pdrop": 0.1}, "resid_pdrop"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type.*linear"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3,
                       "shrink": 2}}, "unknown key.*shrink"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [1.0] * 3}},
     "long_factor must list one factor per rotary frequency"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.1}}, "rotary_fraction"),
])
def test_what_phi3_cannot_express_is_refused_by_name(change, match):
    with pytest.raises(LmforgeError, match=match):
        hf_to_model_config(_phi3(**change))


@pytest.mark.parametrize("alias", ["su", "yarn"])
def test_old_longrope_names_are_read_as_longrope(alias):
    """Phi3Config reads the 4.x names "su" and "yarn" as longrope; the top-level original length wins."""
    hf = _phi3(original_max_position_embeddings=16, max_position_embeddings=64,
               rope_scaling={"type": alias, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                             "original_max_position_embeddings": 8})
    hf.pop("rope_parameters")
    sc = hf_to_model_config(hf).rope_scaling
    assert (sc.type, sc.original_max_position_embeddings, sc.factor, sc.long_factor) == ("longrope", 16, 4.0,
                                                                                        [2.0] * 4)


def test_export_refuses_what_phi3_cannot_hold(phi3):
    name, hf, _, ours = phi3
    for update, match in (({"qkv_bias": True}, "qkv_bias"), ({"norm": "layernorm"}, "norm"),
                          ({"rope_scaling": RopeScalingConfig(type="linear", factor=2.0)}, "longrope only")):
        with pytest.raises(LmforgeError, match=match):
            model_config_to_hf(ours.cfg.model_copy(update=update), model_type="phi3")
    with pytest.raises(LmforgeError, match="set model.hf_model_type=null"):
        model_config_to_hf(ours.cfg.model_copy(update={"qkv_bias": True}))  # phi3 from hf_model_type
    if ours.cfg.rotary_fraction == 1.0:  # without the record, the flags pick a Llama-family export
        plain = model_config_to_hf(ours.cfg.model_copy(update={"hf_model_type": None}))
        assert plain["model_type"] in ("llama", "mistral")


# ------------------------------------------------------------------------------------ LoRA -> PEFT

LORA_CASES = {
    # HF names of the fused modules: every projection they hold gets an adapter (rank 3r / 2r in PEFT).
    "fused_targets": dict(targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], rslora=False,
                          dora=False),
    # Some parts of a fused module: zero blocks for k and for up; rsLoRA's alpha / sqrt(rank) rescaled.
    "some_parts_rslora": dict(targets=["q_proj", "v_proj", "gate_proj"], rslora=True, dora=False),
    # DoRA with every part of each fused module adapted: magnitudes concatenated.
    "dora_all_linear": dict(targets="all-linear", rslora=False, dora=True),
}


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_lora_finetuned_phi3_exports_to_peft_with_equal_logits(phi3, case, tmp_path):
    """LoRA on the imported model, a few AdamW steps, then our PEFT adapter on transformers' export of
    the base: PeftModel.from_pretrained gives our logits (1e-5)."""
    name, hf, path, _ = phi3
    if name == "head_dim_window_tied" and case != "fused_targets":
        pytest.skip("one case covers this shape")
    peft = pytest.importorskip("peft")
    from lmforge.finetune.lora import apply_lora, lora_layers
    from lmforge.finetune.peft_io import load_peft_adapter, save_peft_adapter

    spec = LORA_CASES[case]
    ours = from_hf(path)
    apply_lora(ours, spec["targets"], r=4, alpha=8, rslora=spec["rslora"], dora=spec["dora"])
    opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-2)
    ids = _ids(30, seed=9)
    for _ in range(3):  # B starts at zero: training makes every block of the fused adapters nonzero
        logits = ours(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    ours.eval()
    save_peft_adapter(ours, tmp_path / "adapter", None, ours.cfg)
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert set(saved["target_modules"]) <= {f"model.layers.{i}.{m}" for i in range(3) for m in
                                            ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                             "mlp.down_proj")}
    ranks = {k.replace("\\", "").rsplit(".", 1)[-1]: v for k, v in saved["rank_pattern"].items()}
    assert ranks == ({"qkv_proj": 8} if case == "some_parts_rslora" else {"qkv_proj": 12, "gate_up_proj": 8})
    base = transformers.Phi3ForCausalLM.from_pretrained(path).float().eval()
    ref = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    x = _ids(40, seed=10)
    with torch.no_grad():
        got, want = ours(x), ref(input_ids=x).logits
        assert (got - hf(x).logits).abs().amax() > 1e-3  # the adapters did change the model
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    # And back (finetune.init_adapter): the same per-projection adapters, not the fused union.
    again = from_hf(path).eval()
    assert load_peft_adapter(again, tmp_path / "adapter") == list(lora_layers(ours))
    mine, back = dict(ours.named_parameters()), dict(again.named_parameters())
    assert mine.keys() == back.keys() and all(torch.equal(mine[k], back[k]) for k in mine)


def test_dora_on_part_of_a_fused_module_is_refused(phi3, tmp_path):
    name, _, path, _ = phi3
    if name != "gqa_partial":
        pytest.skip("one shape is enough")
    from lmforge.finetune.lora import apply_lora
    from lmforge.finetune.peft_io import save_peft_adapter

    ours = from_hf(path)
    apply_lora(ours, ["q_proj", "v_proj"], r=2, alpha=4, dora=True)
    with pytest.raises(LmforgeError, match=r"DoRA adapter on .*qkv_proj.*missing: layers.0.attn.wk"):
        save_peft_adapter(ours, tmp_path, None, ours.cfg)


@pytest.mark.parametrize("dora,rslora", [(False, False), (True, True)])
def test_peft_adapter_on_fused_modules_loads_into_ours(phi3, dora, rslora, tmp_path):
    """A PEFT adapter trained on the original checkpoint (one LoRA per qkv_proj / gate_up_proj) loads as
    adapters on each of our parts, sharing A and splitting B's (and DoRA's magnitude's) rows."""
    name, hf, path, _ = phi3
    if name == "head_dim_window_tied" and dora:
        pytest.skip("one case covers this shape")
    peft = pytest.importorskip("peft")
    from lmforge.finetune.peft_io import load_peft_adapter

    base = transformers.Phi3ForCausalLM.from_pretrained(path).float().eval()
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["qkv_proj", "o_proj", "gate_up_proj"],
                             init_lora_weights=False, use_dora=dora, use_rslora=rslora)
    ref = peft.get_peft_model(base, config).eval()
    with torch.no_grad():  # DoRA starts with m = ||W + sBA||, which hides how m's rows are split: move it
        for pname, p in ref.named_parameters():
            if "lora_magnitude" in pname:
                p.mul_(1.0 + 0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    ref.save_pretrained(tmp_path)
    ours = from_hf(path).eval()
    wrapped = load_peft_adapter(ours, tmp_path)
    assert {"layers.0.attn.wq", "layers.0.attn.wk", "layers.0.attn.wv", "layers.1.mlp.w_up"} <= set(wrapped)
    assert "layers.0.mlp.w_down" not in wrapped
    x = _ids(30, seed=11)
    with torch.no_grad():
        got, want = ours(x), ref(input_ids=x).logits
        assert (want - hf(x).logits).abs().amax() > 1e-2  # the adapter changes the model
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_sft_lora_run_exports_a_peft_adapter_for_the_original_phi3(tmp_path):
    """`lmforge sft` with LoRA on qkv_proj / gate_up_proj from a Phi-3 dir, `lmforge export --adapter`:
    the adapter loads with PEFT onto the original checkpoint (not only onto our export of it) and gives
    our logits; the base and the merged exports are phi3."""
    peft = pytest.importorskip("peft")
    from lmforge.checkpoint.runs import run_config
    from lmforge.cli import main
    from lmforge.data.instruct_tasks import generate, write_jsonl
    from lmforge.data.tokenizer import Tokenizer
    from lmforge.finetune.setup import load_finetuned

    records = generate(None, 100, seed=1)
    text = " ".join(m["content"] for r in records for m in r["messages"])
    tok = Tokenizer.train([text * 2], 300, 2)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(tmp_path / "tok.json")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok.json"),
                                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf_tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                            "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, partial_rotary_factor=1.0, pad_token_id=None,
                                  bos_token_id=None, eos_token_id=None)
    transformers.Phi3ForCausalLM(cfg).save_pretrained(tmp_path / "model")  # Phi-4 style: full rotary
    hf_tok.save_pretrained(tmp_path / "model")
    write_jsonl(records, tmp_path / "chat.jsonl")
    run, out = tmp_path / "run", tmp_path / "out"
    sets = [f"run.dir={run}", f"model.init_from={tmp_path / 'model'}",
            f"sft.data=[{tmp_path / 'chat.jsonl'}]",
            "train.seq_len=96", "train.max_steps=3", "train.micro_batch_size=4", "train.eval_every=0",
            "train.precision=fp32", "finetune.method=lora", "finetune.targets=[qkv_proj,gate_up_proj]",
            "optim.lr=1e-2", "schedule.warmup_steps=0", "logging.progress=none"]
    assert main(["sft", *[a for s in sets for a in ("--set", s)]]) == 0
    assert main(["export", str(run), str(out), "--adapter"]) == 0
    assert json.loads((out / "base" / "config.json").read_text())["model_type"] == "phi3"
    ours = load_finetuned(*run_config(run))[0].eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    x = torch.randint(0, len(hf_tok), (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = original(x).logits
        ref = peft.PeftModel.from_pretrained(original, out / "adapter").eval()
        got = ours(x)
        assert (got - before).abs().amax() > 1e-3  # the adapters did change the model
        torch.testing.assert_close(got, ref(x).logits, rtol=0, atol=ATOL)
    assert main(["export", str(run), str(tmp_path / "merged")]) == 0
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "phi3"
    # The adapters back in: a new run starting from them begins where this one ended.
    again = tmp_path / "again"  # the --set values below win over the earlier ones
    sets += [f"run.dir={again}", f"finetune.init_adapter={out / 'adapter'}", "optim.lr=1e-12",
             "train.max_steps=1"]
    assert main(["sft", *[a for s in sets for a in ("--set", s)]]) == 0
    with torch.no_grad():
        torch.testing.assert_close(load_finetuned(*run_config(again))[0].eval()(x), got, rtol=0, atol=1e-4)


def test_a_tampered_fused_adapter_is_refused(phi3, tmp_path):
    """lmforge reads its fused Phi-3 file back only if B is exactly the block-diagonal union it wrote."""
    name, _, path, _ = phi3
    if name != "gqa_partial":
        pytest.skip("one shape is enough")
    from safetensors.torch import load_file, save_file

    from lmforge.finetune.lora import apply_lora
    from lmforge.finetune.peft_io import load_peft_adapter, save_peft_adapter

    ours = from_hf(path)
    apply_lora(ours, ["qkv_proj"], r=2, alpha=4, init="seeded", seed=1)
    save_peft_adapter(ours, tmp_path, None, ours.cfg)
    file = tmp_path / "adapter_model.safetensors"
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(file))
    key = "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"
    tensors[key][0, -1] = 0.5  # q's row, v's block
    save_file(tensors, str(file), metadata=metadata)
    with pytest.raises(LmforgeError, match="qkv_proj is not block-diagonal"):
        load_peft_adapter(from_hf(path), tmp_path)


def test_loops_that_cannot_recompute_their_cache_refuse_to_cross_the_longrope_switch(phi3):
    """The serving engine (rows share forwards) and speculative decoding keep their caches: past the
    original length they would differ from transformers, so such requests are refused by name, while
    requests within it run (and equal transformers')."""
    name, hf, _, ours = phi3
    if name != "longrope":
        pytest.skip("longrope only")
    from lmforge.models.speculative import speculative_generate
    from lmforge.serve.engine import Engine, SamplingParams

    engine = Engine(ours, lambda ids: " ".join(map(str, ids)), max_batch_size=2)
    with pytest.raises(LmforgeError, match="the serving engine: .*longrope.*past 24 tokens"):
        engine.submit([[5] * 12], SamplingParams(max_tokens=16, temperature=0.0), lambda ev: None)
    engine.submit([[5] * 12], SamplingParams(max_tokens=12, temperature=0.0), lambda ev: None)  # 24: fine
    with pytest.raises(LmforgeError, match="speculative decoding: .*longrope"):
        speculative_generate(ours, ours, [5] * 12, 16)
    prompt = torch.randint(3, V, (1, 8), generator=torch.Generator().manual_seed(7))
    got, _ = speculative_generate(ours, ours, prompt[0].tolist(), 16)
    with torch.no_grad():
        want = hf.generate(prompt, do_sample=False, max_new_tokens=16, pad_token_id=0)[0, 8:].tolist()
    assert got == want


def test_import_cli_refuses_an_unsupported_rope_setting_with_exit_2(phi3, tmp_path, capsys):
    """`lmforge import` of a Phi-3 dir whose rope dict has a key transformers does not know: one line
    naming it, exit status 2, nothing written."""
    name, _, path, _ = phi3
    if name != "longrope":
        pytest.skip("one dir is enough")
    import shutil

    from lmforge.cli import main

    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_parameters"]["squeeze"] = 2.0
    (bad / "config.json").write_text(json.dumps(cfg))
    assert main(["import", str(bad), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmforge import: error:") and "squeeze" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert main(["import", str(path), str(tmp_path / "good")]) == 0


def test_compiled_forward_with_packed_positions_keeps_the_short_factors(phi3, monkeypatch):
    """Compiled, the forward does not read position_ids on the host; a row of 40 tokens packing two
    documents of 20 (positions 0..19 twice) stays below the original 24, so transformers uses the short
    factors, and so must we (the long ones only when a position reaches 24)."""
    name, hf, _, ours = phi3
    if name != "longrope":
        pytest.skip("longrope only")
    ids = _ids(40, seed=12)
    packed = torch.arange(20).repeat(2)[None].expand(2, -1)
    long_doc = torch.cat([torch.arange(10), torch.arange(30)])[None].expand(2, -1)
    with torch.no_grad():
        want = {k: hf(ids, position_ids=p).logits for k, p in (("packed", packed), ("long", long_doc))}
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the traced branch, run eagerly
        for key, pos in (("packed", packed), ("long", long_doc)):
            torch.testing.assert_close(ours(ids, position_ids=pos), want[key], rtol=0, atol=ATOL)
