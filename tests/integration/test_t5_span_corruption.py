"""configs/t5/tiny.yaml end to end on the shipped corpus: prepare adds T5's sentinels, the encoder-decoder
pretrains by span corruption (loss falls), its loss equals transformers' T5 loss on the same batch after
export, a crashed run resumes bit for bit, `eval loss` reports the last validation, `generate` prints text,
and what T5 training cannot do yet is refused before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import CORPUS, Crash, CrashAt
from lmforge.checkpoint.hf_io import export_hf
from lmforge.checkpoint.runs import load_model, run_config
from lmforge.config import load_config
from lmforge.data import Tokenizer
from lmforge.data.batch import TokenBatch
from lmforge.data.seq2seq import SENTINELS
from lmforge.engine.objectives import build_objective
from lmforge.errors import ConfigError
from lmforge.eval.open_run import evaluate, generate_text
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, train

T5_TINY = Path(__file__).resolve().parents[2] / "configs" / "t5" / "tiny.yaml"
COMPARED = ("step", "loss", "accuracy", "grad_norm", "lr", "val_loss", "val_accuracy")


def overrides(run_dir: Path, data_dir: Path, *extra: str) -> list[str]:
    return [f"run.dir={run_dir}", f"data.dir={data_dir}", f"data.sources=[{CORPUS}]", "data.max_chars=400000",
            "data.tokenizer.train_chars=300000", "logging.progress=none", "logging.plot=false", *extra]


def curve(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in COMPARED if k in r} for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("t5") / "data"


def test_tiny_t5_pretrains_evaluates_and_matches_transformers(tmp_path, data_dir):
    run = tmp_path / "run"
    cfg = load_config(T5_TINY, overrides(run, data_dir, "train.max_steps=60", "train.eval_every=30",
                                         "checkpoint.every=0"))
    final = train(cfg)
    tok = Tokenizer.load(data_dir / "tokenizer.json")
    # the sentinels follow the BPE's ids, <extra_id_0> last as in T5's vocabulary
    assert tok.token_id(SENTINELS[0]) == tok.vocab_size - 1 and tok.token_id(SENTINELS[99]) == 512
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    vals = [r for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0 and vals[-1]["val_loss"] < vals[0]["val_loss"]
    assert final["loss"] == vals[-1]["val_loss"]
    report = evaluate(run, ["eval.max_batches=8", "eval.batch_size=16"], say=lambda *_: None)
    assert report["loss"] == pytest.approx(vals[-1]["val_loss"], rel=1e-5)
    assert report["accuracy"] == pytest.approx(vals[-1]["val_accuracy"], abs=1e-6)
    texts = generate_text(run, ["generate.prompt='def f(x):'", "generate.max_new_tokens=8",
                                "generate.temperature=0"])
    assert len(texts) == 1 and isinstance(texts[0], str)

    # the exported model's own loss (labels -> shifted decoder inputs from pad id 0) is ours, per target
    transformers = pytest.importorskip("transformers")
    export_hf(run, tmp_path / "hf", say=lambda *_: None)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    ours, _ = load_model(*run_config(run))
    objective = build_objective(cfg).bind(tok)
    stream = torch.tensor([tok.encode(CORPUS.read_text()[:4000])[:2 * 64]]).view(2, 64)
    batch = objective.batch_of(TokenBatch(stream, stream))
    assert batch.input_ids.shape == (2, 64 - 10 + 3 + 1) and batch.targets.shape == (2, 10 + 3 + 1)
    with torch.no_grad():
        out = objective(ours.eval(), batch)
        want = hf(input_ids=batch.input_ids, labels=batch.targets).loss
    torch.testing.assert_close(out.loss / batch.targets.numel(), want, atol=1e-5, rtol=0)


def test_crashed_t5_run_resumes_bit_for_bit(tmp_path, data_dir):
    extra = ("train.max_steps=12", "checkpoint.every=5", "train.eval_every=6", "train.log_every=1",
             "train.micro_batch_size=4")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    train(load_config(T5_TINY, overrides(straight, data_dir, *extra)))
    with pytest.raises(Crash):
        Trainer(load_config(T5_TINY, overrides(crashed, data_dir, *extra)), callbacks=[CrashAt(7)]).fit()
    train(load_config(T5_TINY, overrides(crashed, data_dir, *extra)), resume=True)
    a, b = curve(straight), curve(crashed)
    assert [r["step"] for r in a] == [r["step"] for r in b] and len(a) > 12
    assert a == b  # every loss, accuracy and validation metric, exactly


@pytest.mark.parametrize(("extra", "message"), [
    (("parallel.tp=2",), "parallel.tp=2 is not available"),
    (("train.activation_checkpointing=full",), "train.activation_checkpointing=full is not available"),
    (("objective.name=causal_lm",), "objective.name=causal_lm does not fit model.arch=t5"),
    (("span_corruption.mean_noise_span_length=1",), "encoder inputs of 65 and targets of 21 tokens"),
])
def test_what_t5_training_refuses(tmp_path, data_dir, extra, message):
    run = tmp_path / "run"
    with pytest.raises((ConfigError, ValueError), match=message):
        train(load_config(T5_TINY, overrides(run, data_dir, *extra)))
    assert not (run / "checkpoints").exists()


def test_estimate_refuses_t5(tmp_path, data_dir):
    from lmforge.tools.estimate import estimate

    with pytest.raises(ConfigError, match=r"model.arch=t5 \(encoder-decoder\) is not modelled yet"):
        estimate(load_config(T5_TINY, overrides(tmp_path / "run", data_dir)))
