"""DeepSeek-V3 against transformers: multi-head latent attention (model.mla) and its MoE (sigmoid
scores, group-limited top-k, the routing bias, routed scaling, shared experts, dense first blocks).

Tiny random DeepseekV3ForCausalLM saved by transformers (odd shapes: d_model 40 over 3 heads of q/k
size 20 and value size 10; randomized norms and routing bias) import with equal float32 logits (1e-5),
export to a dir transformers loads with equal logits, and greedy decoding through our compressed KV cache
equals transformers' generate for 16 tokens; one variant extends its RoPE with yarn as DeepSeek-V3
does. LoRA on an imported model trains, saves as a PEFT adapter,
and PeftModel.from_pretrained gives our logits. The new block flags are tested on their own below.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.cli import main
from lmforge.config.schema import ModelConfig, MoEConfig
from lmforge.errors import ConfigError, LmforgeError
from lmforge.finetune.lora import apply_lora, lora_layers
from lmforge.finetune.peft_io import save_peft_adapter
from lmforge.models.common.attention import KVCache
from lmforge.models.common.mla import MLA, expanded_kv_bytes_per_token, kv_cache_bytes_per_token
from lmforge.models.generation import sample_replies
from lmforge.models.hf import from_hf, hf_to_model_config, load_pretrained, to_hf
from lmforge.models.moe import Router, limit_groups
from lmforge.models.transformer import build_model

transformers = pytest.importorskip("transformers")

V, T, NEW, ATOL = 96, 16, 16, 1e-5
SHAPE = dict(vocab_size=V, hidden_size=40, intermediate_size=56, moe_intermediate_size=24,
             num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3, n_routed_experts=8,
             num_experts_per_tok=3, kv_lora_rank=20, qk_rope_head_dim=6, qk_nope_head_dim=14, v_head_dim=10,
             max_position_embeddings=64, first_k_dense_replace=1, eos_token_id=2, pad_token_id=0,
             bos_token_id=1)
VARIANTS = {
    # Plain q projection, DeepSeek's interleaved RoPE, 4 groups of which 2 may be routed to, untied.
    "q_plain": dict(q_lora_rank=None, rope_interleave=True, n_group=4, topk_group=2, n_shared_experts=2,
                    routed_scaling_factor=2.5, tie_word_embeddings=False),
    # Low-rank q with its norm, half-split yarn RoPE (DeepSeek-V3's mscale ratio and its softmax factor),
    # attention biases, tied, unnormalised top-k, no groups.
    "q_lora": dict(q_lora_rank=12, rope_interleave=False, attention_bias=True, n_group=1, topk_group=1,
                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 0.9, "mscale_all_dim": 0.7,
                                    "original_max_position_embeddings": 16, "rope_theta": 10000.0},
                   n_shared_experts=1, norm_topk_prob=False, routed_scaling_factor=1.5,
                   tie_word_embeddings=True),
}


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights and routing bias, norms around 1 (HF's init of norms to 1, biases and the routing bias
    to 0 would hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    """(variant, HF dir, transformers model, our imported model)."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**SHAPE, **VARIANTS[request.param])
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    randomize(hf)
    hf.generation_config.eos_token_id = None  # generate exactly NEW tokens
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, path, hf, from_hf(path).eval()


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, V, (2, T), generator=torch.Generator().manual_seed(seed))


def test_import_gives_equal_logits(pair):
    _, _, hf, ours = pair
    assert isinstance(ours.layers[0].attn, MLA) and not ours.layers[0].is_moe and ours.layers[1].is_moe
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()), hf(_ids()).logits, rtol=0, atol=ATOL)


def test_export_loads_in_transformers_with_equal_logits_and_reimports(pair, tmp_path):
    name, path, hf, ours = pair
    to_hf(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "deepseek_v3"
    assert written["rope_interleave"] is VARIANTS[name]["rope_interleave"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(_ids(1)).logits, hf(_ids(1)).logits, rtol=0, atol=ATOL)
    assert hf_to_model_config(written) == ours.cfg
    reloaded = build_model(ours.cfg)
    load_pretrained(tmp_path, reloaded)  # model.init_from: the routing bias is loaded too
    for (n, a), b in zip(ours.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), n


def test_greedy_generation_with_the_compressed_cache_matches_hf_generate(pair):
    _, _, hf, ours = pair
    ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left-padded second prompt
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=0)
    prompts = [ids[0].tolist(), ids[1, 3:].tolist()]
    assert sample_replies(ours, prompts, NEW, frozenset()) == ref[:, ids.shape[1]:].tolist()


def test_cache_holds_the_latent_and_the_shared_rotated_key(pair):
    _, _, _, ours = pair
    cache = KVCache(ours, 2, 10)
    assert cache.k[0].shape == (2, 1, 10, 20) and cache.v[0].shape == (2, 1, 10, 6)
    ids = _ids()[:, :10]
    with torch.no_grad():
        full = ours(ids)
        step = torch.cat([ours(ids[:, :6], cache=cache), ours(ids[:, 6:8], cache=cache),
                          ours(ids[:, 8:9], cache=cache), ours(ids[:, 9:], cache=cache)], dim=1)
    torch.testing.assert_close(step, full, rtol=0, atol=ATOL)


# DeepSeek-V3's own config.json (deepseek-ai/DeepSeek-V3, without its fp8 quantization_config): the keys
# transformers ignores (aux_loss_alpha, seq_aux, ep_size) change nothing here either.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def test_deepseek_v3_config_sizes_and_kv_cache_per_token():
    from lmforge.models.common.mla import yarn_softmax_factor
    from lmforge.models.flops import count_params

    cfg = hf_to_model_config(DEEPSEEK_V3)
    assert cfg.max_seq_len == 163840 and cfg.rope_scaling.type == "yarn" and cfg.moe.dense_layers == 3
    # 671B parameters, 37B active per token: the sizes DeepSeek gives (the MTP module not counted)
    assert count_params(cfg) == 671_026_404_352 and count_params(cfg, active=True) == 37_552_282_624
    assert yarn_softmax_factor(cfg) == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    # 61 layers x (512 latent + 64 rotated key) numbers, bf16
    assert kv_cache_bytes_per_token(cfg) == 61 * 576 * 2 == 70_272
    # the expanded per-head keys (128 + 64) and values (128) of 128 heads the latent stands for
    assert expanded_kv_bytes_per_token(cfg) == 61 * 128 * 320 * 2 == 4_997_120
    gqa = ModelConfig(d_model=7168, n_layers=61, n_heads=128, n_kv_heads=8, head_dim=128)
    assert kv_cache_bytes_per_token(gqa) == 61 * 2 * 8 * 128 * 2 == 249_856


def test_lora_trains_and_its_peft_adapter_gives_our_logits(pair, tmp_path):
    peft = pytest.importorskip("peft")
    _, path, _, _ = pair
    ours = from_hf(path)
    # The attention: what PEFT can hold for DeepSeek-V3 (the q projection is wq or wq_a + wq_b).
    q = ["wq"] if ours.cfg.mla.q_lora_rank is None else ["q_a_proj", "wq_b"]
    apply_lora(ours, [*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"], r=4, alpha=8)
    params = [p for p in ours.parameters() if p.requires_grad]
    assert params and all(".lora_" in n for n, p in ours.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = _ids(3)
    losses = []
    for _ in range(4):
        loss = F.cross_entropy(ours(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    ours.eval()
    save_peft_adapter(ours, tmp_path / "adapter", str(path), ours.cfg)
    base = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()), theirs(_ids()).logits, rtol=0, atol=ATOL)


def test_lora_on_the_router_or_the_stacked_experts_is_refused_by_name(pair, tmp_path):
    _, path, _, _ = pair
    ours = from_hf(path)
    with pytest.raises(ConfigError, match=r"matches no linear layer.*attn\.wkv_a"):
        apply_lora(ours, ["experts"], r=2, alpha=4)
    apply_lora(ours, ["router.gate", "wo"], r=2, alpha=4)
    assert "layers.1.moe.router.gate" in lora_layers(ours)  # trainable; only its PEFT form is refused
    with pytest.raises(LmforgeError, match="router is no linear layer in transformers.*kv_b_proj"):
        save_peft_adapter(ours, tmp_path, str(path), ours.cfg)
    mlp = from_hf(path)
    apply_lora(mlp, ["shared.w_up"], r=2, alpha=4)
    with pytest.raises(LmforgeError, match="routed experts' stacked weights.*o_proj"):
        save_peft_adapter(mlp, tmp_path, str(path), mlp.cfg)
    assert not (tmp_path / "adapter_config.json").exists()


# ------------------------------------------------------------------------------ refused configs


@pytest.mark.parametrize("update, needle", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "default or yarn"),
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_configs_lmforge_cannot_build_are_refused(update, needle, tmp_path, capsys):
    hf_cfg = {**transformers.DeepseekV3Config(**SHAPE, **VARIANTS["q_plain"]).to_dict(), **update}
    with pytest.raises(LmforgeError, match=needle):
        hf_to_model_config(hf_cfg)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_cfg))
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_mla_config_clashes_and_export_limits_are_clear():
    mla = {"kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4}
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        ModelConfig(vocab_size=V, n_heads=4, n_kv_heads=2, mla=mla)
    with pytest.raises(ValueError, match="qk_rope_head_dim=5 must be even"):
        ModelConfig(vocab_size=V, mla={**mla, "qk_rope_head_dim": 5})
    with pytest.raises(ValueError, match="n_group=3 must divide"):
        MoEConfig(n_experts=8, top_k=2, n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="dense_layers=5 exceeds n_layers=4"):
        ModelConfig(vocab_size=V, moe={"dense_layers": 5})
    softmax = build_model(ModelConfig(vocab_size=V, d_model=16, n_heads=2, n_layers=1, mla=mla,
                                      moe={"n_experts": 4, "top_k": 1, "n_shared_experts": 1}))
    with pytest.raises(LmforgeError, match="router_score=softmax"):
        to_hf(softmax, "unused")


# ------------------------------------------------------------------------------ the flags alone


def test_group_limit_routes_only_within_the_best_groups():
    # Groups {0,1} {2,3} {4,5}: expert 4 has the best single score, but its group's two best sum lowest.
    choice = torch.tensor([[0.5, 0.5, 0.45, 0.45, 0.85, 0.01]])
    limited = limit_groups(choice, n_group=3, topk_group=2)
    assert torch.equal(limited[0, :4], choice[0, :4]) and torch.isinf(limited[0, 4:]).all()
    router = Router(6, MoEConfig(n_experts=6, top_k=2, router_score="sigmoid", n_group=3, topk_group=2,
                                 routed_scaling=2.5))
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(6))
    _, scores, weights, experts = router(torch.logit(choice))
    assert sorted(experts[0].tolist()) == [0, 1]
    torch.testing.assert_close(weights, torch.full((1, 2), 0.5 * 2.5))  # renormalised, then scaled


def test_dense_layers_keep_an_mlp_of_d_ff():
    model = build_model(ModelConfig(vocab_size=V, d_model=16, n_heads=2, n_layers=3, d_ff=24,
                                    moe={"n_experts": 4, "top_k": 1, "d_ff_expert": 8, "dense_layers": 2}))
    assert [b.is_moe for b in model.layers] == [False, False, True]
    assert model.layers[1].mlp.w_up.weight.shape == (24, 16)
    assert model.layers[2].moe.experts.w_up.shape == (4, 8, 16)


def test_serving_engine_batches_an_mla_model_as_generate_does(pair):
    from lmforge.eval.generate import generate
    from lmforge.serve.engine import Engine, SamplingParams

    _, _, _, ours = pair
    text = lambda ids: "".join(chr(0x100 + t) for t in ids)  # noqa: E731  one character per token
    engine = Engine(ours, text, max_batch_size=2)
    prompts = [[5, 17, 42], [8, 9, 10, 11, 12, 13], [7]]  # three requests for two slots
    got: list[list[str]] = [[] for _ in prompts]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    for p, sink in zip(prompts, got):
        engine.submit([p], greedy, lambda ev, s=sink: s.append(ev.text))
    while engine.step():
        pass
    for p, sink in zip(prompts, got):
        assert "".join(sink) == text(generate(ours, p, 6, temperature=0.0)[0])


@pytest.mark.parametrize("mla, moe", [
    ({"q_lora_rank": None}, None),
    ({"q_lora_rank": 12, "attention_bias": True}, {"n_experts": 4, "top_k": 2, "n_shared_experts": 1,
                                                   "d_ff_expert": 8, "dense_layers": 1}),
])
def test_parameter_and_flop_counts_cover_mla_and_dense_layers(mla, moe):
    from lmforge.jobserver.limits import model_params
    from lmforge.models.flops import count_params, flops_per_token

    sizes = {"kv_lora_rank": 10, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5}
    cfg = ModelConfig(vocab_size=V, d_model=24, n_layers=3, n_heads=3, d_ff=40, mla={**sizes, **mla}, moe=moe,
                      bias=False)
    model = build_model(cfg)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    assert model_params(cfg, V) == count_params(cfg)
    # attention term: 3 * L * H * (qk + v) * T on top of 6 per matmul weight
    assert flops_per_token(cfg, 32) - flops_per_token(cfg, 16) == 3 * 3 * 3 * (10 + 5) * 16


def test_tools_that_do_not_model_latent_attention_refuse_it(capsys):
    from lmforge.compress.prune import PruneSpec, units_to_remove
    from lmforge.config.schema import ParallelConfig
    from lmforge.parallel.dims import ParallelDims

    cfg = ModelConfig(vocab_size=V, d_model=24, n_heads=4, mla={"kv_lora_rank": 8, "qk_nope_head_dim": 4,
                                                                 "qk_rope_head_dim": 4, "v_head_dim": 4})
    dims = ParallelDims.resolve(ParallelConfig(tp=2, dp_shard=1), 2)
    with pytest.raises(ConfigError, match="parallel.tp=2 with model.mla"):
        dims.check_model(cfg)
    with pytest.raises(LmforgeError, match=r"--method heads .*model\.mla"):
        units_to_remove(PruneSpec("heads", heads=1), cfg)
    argv = ["estimate", "--set", "model.vocab_size=512", "--set", "model.mla.kv_lora_rank=8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "multi-head latent attention (model.mla)" in err and "Traceback" not in err


def test_lora_sft_run_on_a_deepseek_checkpoint_exports_a_peft_adapter(tmp_path):
    """`lmforge sft` with LoRA on the attention of an imported DeepSeek-V3, then `lmforge export --adapter`:
    transformers + PEFT give the fine-tuned run's logits."""
    peft = pytest.importorskip("peft")
    from lmforge.checkpoint.runs import run_config
    from lmforge.data.instruct_tasks import generate, write_jsonl
    from lmforge.data.tokenizer import Tokenizer
    from lmforge.finetune.setup import load_finetuned

    records = generate(None, 64, seed=1)
    tok = Tokenizer.train([" ".join(m["content"] for r in records for m in r["messages"]) * 2], 300, 2)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(tmp_path / "tok.json")
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok.json"),
                                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf_tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                            "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    shape = {**SHAPE, **VARIANTS["q_lora"], "vocab_size": len(hf_tok), "max_position_embeddings": 128}
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**shape))
    randomize(hf)
    hf.save_pretrained(tmp_path / "model")
    hf_tok.save_pretrained(tmp_path / "model")
    write_jsonl(records, tmp_path / "chat.jsonl")
    run = tmp_path / "run"
    sets = [f"run.dir={run}", f"model.init_from={tmp_path / 'model'}",
            f"sft.data=[{tmp_path / 'chat.jsonl'}]",
            "train.seq_len=96", "train.max_steps=3", "train.micro_batch_size=4", "train.eval_every=0",
            "train.precision=fp32", "finetune.method=lora", "optim.lr=1e-2", "schedule.warmup_steps=0",
            "logging.progress=none",
            "finetune.targets=[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj]"]
    assert main(["sft", *[a for s in sets for a in ("--set", s)]]) == 0
    out = tmp_path / "out"
    assert main(["export", str(run), str(out), "--adapter"]) == 0
    cfg, ckpt = run_config(run)
    ours, _ = load_finetuned(cfg, ckpt)
    # The routing bias is part of the frozen base: it did not move, so the adapter fits the hub checkpoint.
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().sum() > 0 and torch.equal(ours.layers[1].moe.router.expert_bias, bias)
    x = torch.randint(3, len(hf_tok), (1, 24), generator=torch.Generator().manual_seed(4))
    for base_dir in (out / "base", tmp_path / "model"):
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
        theirs = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
        with torch.no_grad():
            torch.testing.assert_close(ours.eval()(x), theirs(x).logits, rtol=0, atol=ATOL)
    with torch.no_grad():
        assert not torch.allclose(ours(x), hf(x).logits, atol=1e-3)  # the adapters trained


def test_packed_rows_through_flex_attention_equal_the_mask():
    # yarn's mscale_all_dim makes the softmax scale differ from flex attention's default 1/sqrt(qk_dim)
    cfg = ModelConfig(vocab_size=V, d_model=24, n_heads=3, n_layers=2, max_seq_len=32,
                      rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                    "mscale_all_dim": 1.0},
                      mla={"kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 4})
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    segments = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    with torch.no_grad():
        masked = model(ids, segment_ids=segments)
        model.packed_attention = "flex"
        flexed = model(ids, segment_ids=segments)
        alone = model(ids[:1, :5])
    torch.testing.assert_close(flexed, masked, rtol=0, atol=ATOL)
    torch.testing.assert_close(masked[:1, :5], alone, rtol=0, atol=ATOL)


def test_deepseek_settings_are_refused_by_the_other_exports(pair, tmp_path):
    _, _, _, ours = pair
    with pytest.raises(LmforgeError, match=r"'qwen2_moe'.*model\.mla is set.*moe\.dense_layers is set"):
        to_hf(ours, tmp_path / "q", model_type="qwen2_moe")
    with pytest.raises(LmforgeError, match=r"'llama'.*model\.mla"):
        to_hf(ours, tmp_path / "l", model_type="llama")
    softmax = ours.cfg.moe.model_copy(update={"router_score": "softmax", "bias_balancing": False})
    grouped = build_model(ModelConfig(vocab_size=V, d_model=16, n_heads=2, n_layers=1, moe=softmax))
    with pytest.raises(LmforgeError, match=r"moe\.routed_scaling is set"):
        to_hf(grouped, tmp_path / "m", model_type="qwen2_moe")
    assert not any((tmp_path / d).exists() for d in ("q", "l", "m"))
