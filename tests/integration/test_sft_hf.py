"""Fine-tuning a Hugging Face model end to end: its own chat template (no generation tags: assistant
tokens found by rendering prefixes), LoRA on it, the adapters out in PEFT's format onto the exported
base (equal logits in transformers + PEFT), and back in as the start of another run."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.checkpoint.runs import run_config
from lmforge.cli import main
from lmforge.data.instruct_tasks import generate, write_jsonl
from lmforge.data.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# Qwen2-style ChatML, as Hub models ship it: no {% generation %} tags, a default system prompt.
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    records = generate(None, 200, seed=1)
    text = " ".join(m["content"] for r in records for m in r["messages"]) + " You are a helpful assistant."
    tok = Tokenizer.train([text * 2], 400, 2)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(root / "tok.json")
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(root / "tok.json"), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf_tok.chat_template = TEMPLATE
    model_dir = root / "model"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    hf_tok.save_pretrained(model_dir)
    write_jsonl(records, root / "chat.jsonl")
    return root


def _sft(tmp_path, hf_dir, name, *extra):
    run = tmp_path / name
    code = main(
        [
            "sft",
            "--set",
            f"run.dir={run}",
            "--set",
            f"model.init_from={hf_dir / 'model'}",
            "--set",
            f"sft.data=[{hf_dir / 'chat.jsonl'}]",
            "--set",
            "train.seq_len=96",
            "--set",
            "train.max_steps=4",
            "--set",
            "train.micro_batch_size=4",
            "--set",
            "train.eval_every=0",
            "--set",
            "train.precision=fp32",
            "--set",
            "finetune.method=lora",
            "--set",
            "optim.lr=1e-2",
            "--set",
            "schedule.warmup_steps=0",
            "--set",
            "logging.progress=none",
            *extra,
        ]
    )
    assert code == 0
    return run


def test_lora_on_a_hub_model_round_trips_through_peft(tmp_path, hf_dir):
    from lmforge.finetune.setup import load_finetuned

    run = _sft(tmp_path, hf_dir, "lora")
    meta = json.loads((run / "data" / "meta.json").read_text())
    assert meta["added_tokens"] == []  # the model's own template needs no new tokens
    assert (run / "data" / "chat_template.jinja").read_text() == TEMPLATE
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir / "model")
    msgs = [{"role": "user", "content": "What is 12 + 7?"}]
    ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]

    cfg, ckpt = run_config(run)
    ours, _ = load_finetuned(cfg, ckpt)
    from lmforge.data.sft import load_prepared_sft
    from lmforge.eval.chat import chat_prompt_ids

    data = load_prepared_sft(run / "data")
    assert chat_prompt_ids(data.template, data.tokenizer, msgs) == list(ids)

    out = tmp_path / "adapter_out"
    assert main(["export", str(run), str(out), "--adapter"]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base")
    ref = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x).logits, rtol=0, atol=1e-5)
        trained = ours(x)

    # The adapters back in: a new run starting from them begins where this one ended.
    again = _sft(
        tmp_path,
        hf_dir,
        "again",
        f"--set=finetune.init_adapter={out / 'adapter'}",
        "--set",
        "optim.lr=1e-12",
        "--set",
        "train.max_steps=1",
    )
    cfg2, ckpt2 = run_config(again)
    resumed, _ = load_finetuned(cfg2, ckpt2)
    with torch.no_grad():
        torch.testing.assert_close(resumed(x), trained, rtol=0, atol=1e-4)


def test_adapter_of_another_shape_is_a_clear_error(tmp_path, hf_dir, capsys):
    run = _sft(tmp_path, hf_dir, "r4", "--set", "finetune.r=4")
    out = tmp_path / "a4"
    assert main(["export", str(run), str(out), "--adapter"]) == 0
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    cfg["r"] = 8  # the config says 8, the tensors are rank 4
    (out / "adapter" / "adapter_config.json").write_text(json.dumps(cfg))
    code = main(
        [
            "sft",
            "--set",
            f"run.dir={tmp_path / 'bad'}",
            "--set",
            f"model.init_from={hf_dir / 'model'}",
            "--set",
            f"sft.data=[{hf_dir / 'chat.jsonl'}]",
            "--set",
            "train.seq_len=96",
            "--set",
            "finetune.method=lora",
            "--set",
            f"finetune.init_adapter={out / 'adapter'}",
            "--set",
            "logging.progress=none",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "adapter_model.safetensors" in err and "shape" in err
