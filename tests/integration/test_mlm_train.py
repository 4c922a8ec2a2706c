"""configs/mlm/tiny.yaml end to end on the shipped corpus: prepare adds the encoder's special tokens, the
encoder trains (loss falls, masked accuracy rises above chance), a crashed run resumes bit for bit,
`eval` reports MLM loss and accuracy, generation verbs refuse the encoder, and the export loads in
transformers as BertForMaskedLM with the same logits, then imports back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import CORPUS, Crash, CrashAt
from lmforge.checkpoint.hf_io import export_hf, import_hf
from lmforge.checkpoint.runs import load_model, run_config
from lmforge.config import load_config
from lmforge.data import Tokenizer
from lmforge.errors import ConfigError
from lmforge.eval.open_run import evaluate, load_run
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, train

MLM_TINY = Path(__file__).resolve().parents[2] / "configs" / "mlm" / "tiny.yaml"
COMPARED = ("step", "loss", "accuracy", "grad_norm", "lr", "val_loss", "val_accuracy")


def overrides(run_dir: Path, data_dir: Path, *extra: str) -> list[str]:
    return [f"run.dir={run_dir}", f"data.dir={data_dir}", f"data.sources=[{CORPUS}]", "data.max_chars=null",
            "logging.progress=none", "logging.plot=false", *extra]


def curve(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in COMPARED if k in r} for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlm") / "data"


def test_tiny_mlm_trains_evaluates_and_exports(tmp_path, data_dir):
    run = tmp_path / "run"
    cfg = load_config(MLM_TINY, overrides(run, data_dir, "train.max_steps=120", "train.eval_every=60",
                                          "checkpoint.every=0"))
    final = train(cfg)
    tok = Tokenizer.load(data_dir / "tokenizer.json")
    assert tok.encoder_ids() is not None and tok.vocab_size == 516  # 512 BPE + [CLS] [SEP] [MASK] [PAD]
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    vals = [r for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.8
    assert vals[-1]["val_loss"] < vals[0]["val_loss"]
    chance = 1 / tok.vocab_size
    assert rows[0]["accuracy"] < 10 * chance < 0.03 < vals[-1]["val_accuracy"]
    assert final["loss"] == vals[-1]["val_loss"]

    # eval: the same masks as the run's last validation (masks are a function of the data)
    report = evaluate(run, ["eval.max_batches=8", "eval.batch_size=16"])
    assert report["accuracy"] == pytest.approx(vals[-1]["val_accuracy"], abs=1e-6)
    assert report["loss"] == pytest.approx(vals[-1]["val_loss"], rel=1e-5)
    with pytest.raises(ConfigError, match="does not generate text"):
        load_run(run)

    # export -> transformers -> the same logits; then import it back as an lmforge run
    transformers = pytest.importorskip("transformers")
    export_hf(run, tmp_path / "hf", say=lambda *_: None)
    hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "BertForMaskedLM"
    ours, _ = load_model(*run_config(run))
    ids = torch.tensor([tok.encode("def f(x):\n    return x + 1\n")[:30]])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, ours.eval()(ids), atol=1e-5, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.mask_token == "[MASK]" and hf_tok.cls_token == "[CLS]"
    import_hf(tmp_path / "hf", tmp_path / "imported", say=lambda *_: None)
    cfg2, _ = run_config(tmp_path / "imported")
    assert cfg2.model.arch == "encoder" and cfg2.objective.name == "mlm"


def test_crashed_mlm_run_resumes_bit_for_bit(tmp_path, data_dir):
    extra = ("train.max_steps=14", "checkpoint.every=5", "train.eval_every=7", "train.log_every=1")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    train(load_config(MLM_TINY, overrides(straight, data_dir, *extra)))
    with pytest.raises(Crash):
        Trainer(load_config(MLM_TINY, overrides(crashed, data_dir, *extra)), callbacks=[CrashAt(8)]).fit()
    train(load_config(MLM_TINY, overrides(crashed, data_dir, *extra)), resume=True)
    a, b = curve(straight), curve(crashed)
    assert [r["step"] for r in a] == [r["step"] for r in b] and len(a) > 14
    assert a == b  # every loss, accuracy and validation metric, exactly
