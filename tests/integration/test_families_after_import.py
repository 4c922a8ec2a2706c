"""Everything after import works on every family lmforge opens: for a tiny random checkpoint of each
Hugging Face model type, saved by transformers with a tokenizer and a ChatML template, `lmforge import`,
then LoRA and DoRA SFT with the adapters exported to PEFT (PeftModel's logits equal lmforge's within
1e-5), QLoRA SFT, DPO (LoRA), `generate --chat`, full SFT exported to Hugging Face (transformers' logits
equal within 1e-5), GRPO, task evaluation, int8 quantization, and an OpenAI-compatible server answering
a chat request.

The README's families table cites this file for the columns after import. One family per parameter;
the per-family parity of the model itself (logits, generation) lives in tests/parity/."""

from __future__ import annotations

import pytest
import torch

from lmforge.cli import main
from lmforge.data.instruct_tasks import generate, pairs_of, split_disjoint, write_jsonl
from lmforge.data.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, tie_word_embeddings=False)
# model_type -> (transformers config class, its ForCausalLM class, extra config keys)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=64)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(intermediate_size=64, sliding_window=32)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=64)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=48, num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=24, num_experts=4,
                                                      num_experts_per_tok=2, pad_token_id=0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=64, head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(intermediate_size=64, head_dim=16,
                                                                moe_intermediate_size=24, num_experts=4,
                                                                num_experts_per_tok=2)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(intermediate_size=64, embedding_multiplier=2.0,
                                                            residual_multiplier=0.5, attention_multiplier=0.3,
                                                            logits_scaling=2.0)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(intermediate_size=64, no_rope_layer_interval=2,
                                                            pad_token_id=0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(intermediate_size=64)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(intermediate_size=64, head_dim=8, sliding_window=16,
                                                         query_pre_attn_scalar=8)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        intermediate_size=64, head_dim=8, sliding_window=16, query_pre_attn_scalar=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(intermediate_size=64, partial_rotary_factor=0.5,
                                                   pad_token_id=0)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=24, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        attention_bias=True, pad_token_id=0)),
}
# LoRA targets whose adapters have a PEFT form (DeepSeek-V3: its attention, as peft reads any MLP target
# there as the routed experts; gpt-oss: its attention; Qwen2-MoE: its attention, as its shared expert's
# adapters have no PEFT names yet, which export refuses by name); the rest adapt every block linear.
TARGETS = {"deepseek_v3": "[q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj]",
           "gpt_oss": "[q_proj,k_proj,v_proj,o_proj]", "qwen2_moe": "[q_proj,k_proj,v_proj,o_proj]"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    records = generate(None, 120, seed=1)
    text = " ".join(m["content"] for r in records for m in r["messages"])
    tok = Tokenizer.train([text * 2], 320, 2)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(root / "tok.json")
    write_jsonl(records, root / "chat.jsonl")
    write_jsonl(pairs_of(records, 2), root / "pairs.jsonl")
    split = split_disjoint(["compare"], 16, 8, seed=9)
    write_jsonl(split.train, root / "prompts.jsonl")
    write_jsonl(split.test, root / "tasks.jsonl")
    return root


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, data, tmp_path_factory):
    config_cls, model_cls, extra = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(data / "tok.json"),
                                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf_tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(vocab_size=len(hf_tok), **{**BASE, **extra})
    getattr(transformers, model_cls)(cfg).save_pretrained(root / "hf")
    hf_tok.save_pretrained(root / "hf")
    assert main(["import", str(root / "hf"), str(root / "imported")]) == 0
    return request.param, root


def _sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def _train(verb: str, run, base, data, *extra: str, targets: str = "[all-linear]") -> None:
    common = [f"run.dir={run}", f"model.init_from={base}", "train.seq_len=96", "train.max_steps=3",
              "train.micro_batch_size=4", "train.eval_every=0", "train.precision=fp32", "train.threads=1",
              "checkpoint.every=0", "logging.progress=none"]
    inputs = {"sft": [f"sft.data=[{data / 'chat.jsonl'}]"],
              "dpo": [f"preference.data=[{data / 'pairs.jsonl'}]"],
              "rl": [f"rl.data=[{data / 'prompts.jsonl'}]", "rl.group_size=2", "rl.max_new_tokens=4",
                     "train.micro_batch_size=2"]}[verb]
    assert main([verb, *_sets(*common, f"finetune.targets={targets}", *inputs, *extra)]) == 0


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_lora_and_dora_sft_export_to_peft_with_equal_logits(family, data, tmp_path, method):
    name, root = family
    run = tmp_path / method
    _train("sft", run, root / "imported", data, f"finetune.method={method}",
           targets=TARGETS.get(name, "[all-linear]"))
    out = tmp_path / "export"
    assert main(["export", str(run), str(out), "--adapter"]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    from lmforge.checkpoint.runs import run_config
    from lmforge.finetune.setup import load_finetuned

    ours, _ = load_finetuned(*run_config(run))
    x = torch.randint(0, ours.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(x), model(x).logits, atol=1e-5, rtol=0), name


def test_qlora_sft_dpo_and_chat_generation_run(family, data, tmp_path, capsys):
    name, root = family
    _train("sft", tmp_path / "qlora", root / "imported", data, "finetune.method=qlora")
    _train("dpo", tmp_path / "dpo", root / "imported", data, "finetune.method=lora")
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "dpo"), "--chat", "--prompt", "What is 2 + 3?",
                 *_sets("generate.max_new_tokens=8", "generate.temperature=0")]) == 0
    assert capsys.readouterr().out.strip(), name


def test_full_sft_exports_then_quantizes_evaluates_and_trains_with_grpo(family, data, tmp_path, capsys):
    name, root = family
    run = tmp_path / "full"
    _train("sft", run, root / "imported", data, "finetune.method=full")
    out = tmp_path / "hf"
    assert main(["export", str(run), str(out)]) == 0
    from lmforge.eval.open_run import load_run

    ours = load_run(run).model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(0, ours.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(ours(x), theirs(x).logits, atol=1e-5, rtol=0), name

    _train("rl", tmp_path / "grpo", run, data, "finetune.method=lora", "rl.algorithm=grpo")
    assert main(["eval", str(run), "--tasks", str(data / "tasks.jsonl"), "--limit", "4"]) == 0
    assert main(["quantize", str(run), str(tmp_path / "int8"), "--bits", "8"]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "int8"), "--prompt", "x",
                 *_sets("generate.max_new_tokens=4", "generate.temperature=0")]) == 0
    assert capsys.readouterr().out.strip(), name


def test_a_served_chat_completion_answers(family):
    """Served from the imported run itself; no output capture here: the server's log handlers outlive
    a test's captured streams."""
    import json
    import urllib.request

    from lmforge.serve import start_server

    name, root = family
    with start_server(root / "imported", api_keys=["k"], model_name=name, max_batch_size=2) as srv:
        body = json.dumps({"model": name, "max_tokens": 4, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is 2 + 3?"}]}).encode()
        headers = {"Authorization": "Bearer k", "Content-Type": "application/json"}
        req = urllib.request.Request(srv.url + "/chat/completions", body, method="POST", headers=headers)
        with urllib.request.urlopen(req, timeout=60) as r:
            reply = json.loads(r.read())
    assert reply["choices"][0]["message"]["role"] == "assistant" and reply["usage"]["completion_tokens"] >= 1
