"""LoRA / QLoRA training of configs/t5/tiny.yaml by span corruption: only the adapters train, a crashed
run resumes bit for bit, `eval loss` and `generate` read the run, `lmforge export --adapter` writes a PEFT
adapter dir that `PeftModel.from_pretrained(T5ForConditionalGeneration...)` loads with our logits, and
the merged export loads in transformers with our logits too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import CORPUS, Crash, CrashAt
from lmforge.checkpoint.runs import load_model, run_config
from lmforge.config import load_config
from lmforge.errors import ConfigError
from lmforge.eval.open_run import evaluate, generate_text
from lmforge.finetune.lora import lora_layers
from lmforge.finetune.setup import load_finetuned
from lmforge.metrics.loggers import read_metrics
from lmforge.models.flops import t5_flops_per_token
from lmforge.train.trainer import Trainer, train

T5_TINY = Path(__file__).resolve().parents[2] / "configs" / "t5" / "tiny.yaml"
COMPARED = ("step", "loss", "accuracy", "grad_norm", "lr", "val_loss", "val_accuracy")


def overrides(run_dir: Path, data_dir: Path, *extra: str) -> list[str]:
    return [f"run.dir={run_dir}", f"data.dir={data_dir}", f"data.sources=[{CORPUS}]", "data.max_chars=200000",
            "data.tokenizer.train_chars=150000", "logging.progress=none", "logging.plot=false",
            "model.d_model=64", "model.d_ff=128", "train.micro_batch_size=4", "train.log_every=1",
            "train.eval_every=6", "train.eval_batches=2", "optim.lr=0.01", *extra]


def curve(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in COMPARED if k in r} for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("t5lora") / "data"


def batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, vocab, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    dec = torch.randint(2, vocab, (2, 6), generator=g)
    dec[:, 0] = 0
    return ids, mask, dec


def test_lora_t5_trains_resumes_and_exports_to_peft(tmp_path, data_dir):
    extra = ("finetune.method=lora", "finetune.targets=[q,v,wi,DenseReluDense.wo]", "train.max_steps=12",
             "checkpoint.every=5")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    train(load_config(T5_TINY, overrides(straight, data_dir, *extra)))
    trainer = Trainer(load_config(T5_TINY, overrides(crashed, data_dir, *extra)), callbacks=[CrashAt(7)])
    # MFU counts T5's FLOPs: rows of 58 and 14 tokens per 64-token window, the base frozen
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert trainer.flops_per_token == t5_flops_per_token(trainer.cfg.model, 58, 14, 64, trainable)
    with pytest.raises(Crash):
        trainer.fit()
    train(load_config(T5_TINY, overrides(crashed, data_dir, *extra)), resume=True)
    a, b = curve(straight), curve(crashed)
    assert [r["step"] for r in a] == [r["step"] for r in b] and len(a) > 12
    assert a == b  # every loss, accuracy and validation metric, exactly
    assert all(r["mfu"] > 0 for r in read_metrics(straight / "metrics.jsonl") if "loss" in r)
    losses = [r["loss"] for r in a if "loss" in r]
    assert losses[-1] < losses[0] - 0.3  # the adapters alone move the loss

    # eval and generate read a LoRA'd T5 run as they read any T5 run
    report = evaluate(straight, ["eval.max_batches=2", "eval.batch_size=4"], say=lambda *_: None)
    assert report["loss"] == pytest.approx([r for r in a if "val_loss" in r][-1]["val_loss"], rel=1e-5)
    texts = generate_text(straight, ["generate.prompt='def f(x):'", "generate.max_new_tokens=4",
                                     "generate.temperature=0"])
    assert len(texts) == 1 and isinstance(texts[0], str)

    cfg, ckpt = run_config(straight)
    model, _ = load_finetuned(cfg, ckpt)
    layers = lora_layers(model)
    # q, v: 2 x 2 in the encoder, 2 x 4 in the decoder (cross too); wi and wo: 2 x 2 x 2
    assert len(layers) == 20
    assert "decoder.layers.1.cross.wv" in layers and "encoder.layers.0.mlp.w_down" in layers
    assert all(float(m.lora_B.abs().amax()) > 0 for m in layers.values())  # B starts at 0: it trained
    earlier, _ = load_finetuned(cfg, ckpt.parent / "step_00000010")  # keep_last 2: steps 10 and 12
    before = dict(earlier.named_parameters())
    for name, p in model.named_parameters():  # the base is frozen, the adapters trained
        assert torch.equal(p, before[name]) != ("lora_" in name), name

    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from lmforge.export.hf import export_adapter, export_run, merge_run

    export_adapter(straight, tmp_path / "peft", say=lambda *_: None)
    export_run(straight, tmp_path / "merged", say=lambda *_: None)
    merge_run(straight, tmp_path / "merged_run", say=lambda *_: None)  # `lmforge merge`: a full T5 run
    folded, _ = load_model(*run_config(tmp_path / "merged_run"))
    assert not lora_layers(folded) and type(folded).__name__ == "T5"
    hf_base = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "peft" / "base").eval()
    ids, mask, dec = batch(cfg.model.vocab_size)
    with torch.no_grad():
        base = hf_base(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    peft_model = peft.PeftModel.from_pretrained(hf_base, tmp_path / "peft" / "adapter").eval()  # in place
    merged = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        ours = model(ids, dec, attention_mask=mask)
        for theirs in (peft_model, merged):
            got = theirs(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
            torch.testing.assert_close(got, ours, atol=1e-5, rtol=0)
        torch.testing.assert_close(folded(ids, dec, attention_mask=mask), ours, atol=1e-5, rtol=0)
    assert (base - ours).abs().amax() > 1e-2  # the adapters changed the model


def test_qlora_t5_trains_and_merges(tmp_path, data_dir):
    run = tmp_path / "run"
    train(load_config(T5_TINY, overrides(run, data_dir, "finetune.method=qlora", "train.max_steps=6",
                                         "checkpoint.every=0")))
    cfg, ckpt = run_config(run)
    model, _ = load_finetuned(cfg, ckpt)
    names = [n for n, m in model.named_modules() if type(m).__name__ == "NF4Linear"]
    assert len(names) == 2 * 6 + 2 * 10 and all(n.endswith(".base") for n in names)  # all-linear, both stacks
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"]

    transformers = pytest.importorskip("transformers")
    from lmforge.export.hf import export_run

    export_run(run, tmp_path / "merged", say=lambda *_: None)
    merged = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "merged").eval()
    ids, mask, dec = batch(cfg.model.vocab_size)
    with torch.no_grad():
        got = merged(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        torch.testing.assert_close(got, model(ids, dec, attention_mask=mask), atol=1e-5, rtol=0)


def test_t5_lora_target_refused_before_any_work(tmp_path, data_dir):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="'wo' is ambiguous on a T5"):
        train(load_config(T5_TINY, overrides(run, data_dir, "finetune.method=lora", "finetune.targets=[wo]")))
    assert not (run / "checkpoints").exists()


def test_t5_throughput_counts_t5_flops(tmp_path, data_dir):
    trainer = Trainer(load_config(T5_TINY, overrides(tmp_path / "run", data_dir, "train.max_steps=1")))
    assert trainer.flops_per_token == t5_flops_per_token(trainer.cfg.model, 58, 14, 64)
