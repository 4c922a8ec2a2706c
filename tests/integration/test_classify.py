"""`lmforge classify` end to end on the shipped labelled set (`lmforge tasks --labelled`): a tiny pretrained
decoder fine-tuned fully and with LoRA, its label map saved in the run dir, `lmforge eval` and `lmforge
classify --report` (whose metrics are scikit-learn's of the same predictions), regression, class weights,
exact resume, and bad label files refused with their file and line (exit status 2, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sklearn import metrics as skm

from conftest import TINY, Crash, CrashAt, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, train


@pytest.fixture(scope="module")
def world(tmp_path_factory, shared_data_dir) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("classify")
    base = tmp / "base"
    train(load_config(TINY, tiny_overrides(base, shared_data_dir, "train.max_steps=30", "checkpoint.every=0",
                                           "train.eval_every=0")))
    assert main(["tasks", "--labelled", "-o", str(tmp / "train.jsonl"), "--test-out", str(tmp / "val.jsonl"),
                 "--n", "240", "--n-test", "64"]) == 0
    return SimpleNamespace(tmp=tmp, base=base, train=tmp / "train.jsonl", val=tmp / "val.jsonl")


def overrides(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [f"model.init_from={w.base}", f"classify.data=[{w.train}]", f"classify.val_data=[{w.val}]",
            f"run.dir={run_dir}", "train.max_steps=6", "train.micro_batch_size=8", "train.grad_accum_steps=2",
            "train.precision=fp32", "train.threads=1", "train.log_every=1", "train.eval_every=3",
            "train.eval_batches=8", "checkpoint.every=3", "checkpoint.keep_last=3", "optim.lr=3e-3",
            "schedule.warmup_steps=1", "logging.progress=none", *extra]


def cli(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [a for o in overrides(w, run_dir, *extra) for a in ("--set", o)]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_shipped_set_is_seeded_and_disjoint(world):
    from lmforge.data.labelled_tasks import labelled_split

    train_recs, val_recs = _records(world.train), _records(world.val)
    assert (train_recs, val_recs) == tuple(map(list, labelled_split(240, 64, 0)))
    assert not {r["sentence"] for r in train_recs} & {r["sentence"] for r in val_recs}
    assert {r["label"] for r in train_recs} == {"negative", "positive"}
    assert labelled_split(20, 5, 1) != labelled_split(20, 5, 0)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_fine_tunes_evaluates_and_reports(world, tmp_path, capsys, method):
    run = tmp_path / method
    extra = ("finetune.method=lora", "finetune.r=4") if method == "lora" else ()
    assert main(["classify", *cli(world, run, *extra)]) == 0
    assert json.loads((run / "data" / "labels.json").read_text()) == ["negative", "positive"]
    saved = load_config(run / "config.yaml")
    assert (saved.model.score_head, saved.model.num_labels) == (True, 2)
    records = read_metrics(run / "metrics.jsonl")
    assert all(np.isfinite(r["loss"]) and 0 <= r["accuracy"] <= 1 for r in records if "loss" in r)
    assert any("val_accuracy" in r for r in records)
    capsys.readouterr()
    assert main(["classify", "--report", "--set", f"run.dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "macro-F1" in out and '"negative"' in out
    report = json.loads(next(run.glob("classify_val_step_*.json")).read_text())
    # the report is scikit-learn's metrics of the run's own predictions on the validation records
    from lmforge.checkpoint.runs import run_config
    from lmforge.eval.classification_metrics import predictions
    from lmforge.eval.open_run import build_run

    cfg, source = run_config(run)
    truth, pred = predictions(build_run(cfg, "eval", weights_from=source))
    assert len(truth) == report["examples"] == 64
    assert report["accuracy"] == pytest.approx(skm.accuracy_score(truth, pred), abs=1e-12)
    assert report["mcc"] == pytest.approx(skm.matthews_corrcoef(truth, pred), abs=1e-12)
    assert report["macro_f1"] == pytest.approx(skm.f1_score(truth, pred, average="macro"), abs=1e-12)
    assert [row["label"] for row in report["per_class"]] == ["negative", "positive"]
    assert main(["eval", str(run)]) == 0
    assert "accuracy" in capsys.readouterr().out
    if method == "full":  # exported: transformers' classifier with the label map's names
        assert main(["export", str(run), str(tmp_path / "hf")]) == 0
        hf = json.loads((tmp_path / "hf" / "config.json").read_text())
        assert hf["architectures"] == ["LlamaForSequenceClassification"]
        assert hf["id2label"] == {"0": "negative", "1": "positive"}
        assert hf["problem_type"] == "single_label_classification"


def test_resume_is_exact(world, tmp_path, capsys):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    extra = ("classify.class_weights=balanced",)
    assert main(["classify", *cli(world, straight, *extra)]) == 0
    with pytest.raises(Crash):
        Trainer(load_config(None, overrides(world, crashed, "objective.name=classify", *extra)),
                callbacks=[CrashAt(5)]).fit()
    assert main(["classify", *cli(world, crashed, *extra), "--resume"]) == 0
    keys = ("step", "loss", "accuracy", "grad_norm", "val_loss", "val_accuracy")
    curve = lambda d: [{k: r[k] for k in keys if k in r} for r in read_metrics(d / "metrics.jsonl")]  # noqa: E731
    assert curve(straight) == curve(crashed)
    assert json.loads((crashed / "labels.json").read_text()) == ["negative", "positive"]
    # resumed on data that maps the classes otherwise: refused, the run left as it was
    flipped = tmp_path / "flipped.jsonl"
    flipped.write_text("".join(json.dumps({**r, "label": {"negative": "bad", "positive": "good"}[r["label"]]})
                               + "\n" for r in _records(world.train)))
    before = (crashed / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["classify", *cli(world, crashed, *extra, f"classify.data=[{flipped}]",
                                  "classify.val_data=[]", f"data.dir={tmp_path / 'other'}",
                                  "train.max_steps=8"), "--resume"]) == 2
    assert "keeps its label map" in capsys.readouterr().err
    assert (crashed / "metrics.jsonl").read_text() == before
    # a new run in its place (run.overwrite) starts a new map
    assert main(["classify", *cli(world, crashed, f"classify.data=[{flipped}]", "classify.val_data=[]",
                                  "train.max_steps=1", "run.overwrite=true")]) == 0
    assert json.loads((crashed / "labels.json").read_text()) == ["bad", "good"]


def test_regression_and_class_weights(world, tmp_path):
    from lmforge.engine.objectives.classify import Classify

    # a regression target: the sentence's length in words
    data = tmp_path / "reg.jsonl"
    data.write_text("".join(json.dumps({"sentence": r["sentence"], "label": len(r["sentence"].split()) / 10})
                            + "\n" for r in _records(world.train)))
    run = tmp_path / "reg"
    assert main(["classify", *cli(world, run, f"classify.data=[{data}]", "classify.val_data=[]",
                                  "classify.num_labels=1")]) == 0
    assert "abs_error" in read_metrics(run / "metrics.jsonl")[0]
    assert not json.loads((run / "data" / "labels.json").read_text())  # a regressor has no label map
    assert main(["classify", "--report", "--set", f"run.dir={run}"]) == 0
    report = json.loads(next(run.glob("classify_val_step_*.json")).read_text())
    assert set(report) >= {"pearson", "spearman", "mse"}
    # the head is read at each row's last real token; the weights scale each example's loss by its
    # class's weight (transformers' weighted cross-entropy, summed: the step divides by the examples)
    from lmforge.data.labelled import LabelledBatch

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.score = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3, bias=False)

        def forward(self, ids, head):
            return head(self.emb(ids), None)

    model, weights = Stub(), [1.0, 2.0, 0.5]
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    lengths, labels = torch.tensor([3, 2, 4]), torch.tensor([2, 1, 0])
    out = Classify(3, weights)(model, LabelledBatch(ids, lengths, labels, 9))
    logits = model.score(model.emb(torch.tensor([3, 5, 9])))
    want = torch.nn.functional.cross_entropy(logits, labels, weight=torch.tensor(weights), reduction="none")
    assert float(out.loss) == pytest.approx(float(want.sum()), abs=1e-6)
    assert float(out.metrics["accuracy"]) == float((logits.argmax(-1) == labels).sum())


BAD = {
    "unknown label": ("val", {"sentence": "the tea was fine", "label": "neutral"}, "unknown label 'neutral'"),
    "missing field": ("train", {"text": "the tea was fine", "label": "positive"}, "field 'sentence'"),
    "out of range": ("train", {"sentence": "the tea was fine", "label": 2}, "out of range"),
    "too many labels": ("train", {"sentence": "the tea was fine", "label": "neutral"},
                        "more than classify.num_labels=2"),
    "not a number": ("train", {"sentence": "the tea was fine", "label": "high"}, "not a finite number"),
    "no label": ("val", {"sentence": "the tea was fine"}, "the label field 'label' is missing"),
    "long name": ("train", {"sentence": "the tea was fine", "label": "x" * 201}, "a class name has 1 to 200"),
    "not json": ("train", "{not json", "train.jsonl:4:"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_label_files_exit_2_with_file_and_line(world, tmp_path, capsys, case):
    split, bad, message = BAD[case]
    good = [r for r in _records(world.train if split == "train" else world.val)][:20]
    if case == "out of range":
        good = [{**r, "label": int(r["label"] == "positive")} for r in good]
    if case == "not a number":
        good = [{**r, "label": len(r["sentence"]) / 10} for r in good]
    path = tmp_path / f"{split}.jsonl"
    rows = [json.dumps(r) if isinstance(r, dict) else r for r in [*good[:3], bad, *good[3:]]]
    path.write_text("".join(row + "\n" for row in rows))
    files = {"train": world.train, "val": world.val, split: path}
    if case == "not a number":
        files["val"] = path
    extra = ["classify.num_labels=1"] if case == "not a number" else []
    run = tmp_path / "run"
    assert main(["classify", *cli(world, run, f"classify.data=[{files['train']}]",
                                  f"classify.val_data=[{files['val']}]", *extra)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:4:" in err and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (run / "checkpoints").exists()


def test_encoder_classifies_pairs_and_exports_as_bert(world, tmp_path, capsys):
    """A masked-LM encoder fine-tuned as a classifier on pairs: [CLS] a [SEP] b [SEP] with token types,
    pooled at [CLS]; its export is transformers' BertForSequenceClassification, which loads it."""
    mlm = tmp_path / "mlm"
    assert main(["train", "-c", str(Path(TINY).parents[1] / "mlm" / "tiny.yaml"),
                 *(a for o in tiny_overrides(mlm, tmp_path / "mlm-data", "train.max_steps=4",
                                             "checkpoint.every=0", "train.eval_every=0", "train.threads=1",
                                             "model.d_model=32", "model.n_layers=1")
                   for a in ("--set", o))]) == 0
    pairs = tmp_path / "pairs.jsonl"
    recs = _records(world.train)
    pairs.write_text("".join(json.dumps({"premise": a["sentence"], "hypothesis": b["sentence"],
                                         "label": int(a["label"] == b["label"])}) + "\n"
                             for a, b in zip(recs, recs[1:])))
    run = tmp_path / "enc"
    assert main(["classify", *cli(world, run, f"model.init_from={mlm}", f"classify.data=[{pairs}]",
                                  "classify.val_data=[]", "classify.text_field=premise",
                                  "classify.text_pair_field=hypothesis", "train.max_steps=3",
                                  "train.eval_every=3", "checkpoint.every=3")]) == 0
    from lmforge.data.labelled import load_prepared_labelled
    from lmforge.data.tokenizer import Tokenizer

    data = load_prepared_labelled(run / "data")
    enc = Tokenizer.load(run / "data" / "tokenizer.json").encoder_ids()
    split = data.split("train")
    first, second = split.example(0), int(split.second[0])
    assert first[0] == enc["cls"] and first[-1] == enc["sep"] and first[second - 1] == enc["sep"]
    assert 2 < second < len(first)
    saved = load_config(run / "config.yaml")
    assert (saved.model.arch, saved.model.score_head, saved.model.num_labels) == ("encoder", True, 2)
    assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["BertForSequenceClassification"] and hf["id2label"] == {"0": "0", "1": "1"}


def test_report_refuses_what_is_not_a_classifier(world, capsys):
    assert main(["classify", "--report", "--set", f"run.dir={world.base}"]) == 2
    assert "not a classifier" in capsys.readouterr().err
