"""`lmforge tag` end to end on the shipped tagged set (`lmforge tasks --tagged`): a tiny
pretrained decoder fine-tuned fully and with LoRA, its tag map in the run dir, `lmforge tag
--report` (seqeval's entity metrics of the run's own predictions), exact resume, an encoder tagger, the
sub-word alignment (the tag on a word's first sub-word, -100 on the rest), the weighted loss, and bad tag
files refused with their file and line (exit status 2, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import TINY, Crash, CrashAt, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, train

TAGS = ["B-FUNC", "B-KW", "B-NUM", "B-STR", "B-VAR", "I-STR", "O"]


@pytest.fixture(scope="module")
def world(tmp_path_factory, shared_data_dir) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("token_classify")
    base = tmp / "base"
    train(load_config(TINY, tiny_overrides(base, shared_data_dir, "train.max_steps=30", "checkpoint.every=0",
                                           "train.eval_every=0")))
    assert main(["tasks", "--tagged", "-o", str(tmp / "train.jsonl"), "--test-out", str(tmp / "val.jsonl"),
                 "--n", "240", "--n-test", "48"]) == 0
    return SimpleNamespace(tmp=tmp, base=base, train=tmp / "train.jsonl", val=tmp / "val.jsonl")


def overrides(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [f"model.init_from={w.base}", f"token_classify.data=[{w.train}]",
            f"token_classify.val_data=[{w.val}]", "token_classify.num_labels=7", f"run.dir={run_dir}",
            "train.max_steps=6", "train.micro_batch_size=8", "train.grad_accum_steps=2",
            "train.precision=fp32", "train.threads=1", "train.log_every=1", "train.eval_every=3",
            "train.eval_batches=8",
            "checkpoint.every=3", "checkpoint.keep_last=3", "optim.lr=3e-3", "schedule.warmup_steps=1",
            "logging.progress=none", *extra]


def cli(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [a for o in overrides(w, run_dir, *extra) for a in ("--set", o)]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_shipped_set_is_seeded_disjoint_and_tagged_by_position(world):
    from lmforge.data.tagged_tasks import tagged_split

    train_recs, val_recs = _records(world.train), _records(world.val)
    assert (train_recs, val_recs) == tuple(map(list, tagged_split(240, 48, 0)))
    line = lambda r: " ".join(r["tokens"])  # noqa: E731
    assert not {line(r) for r in train_recs} & {line(r) for r in val_recs}
    assert {t for r in train_recs for t in r["tags"]} == set(TAGS)
    for r in train_recs:
        assert len(r["tokens"]) == len(r["tags"])
        for i, t in enumerate(r["tags"]):
            if t == "B-FUNC":  # a function is a name called or defined
                assert r["tokens"][i + 1] == "(" or r["tokens"][i - 1] == "def"
            if t == "I-STR":
                assert r["tags"][i - 1] in ("B-STR", "I-STR")
    assert tagged_split(20, 5, 1) != tagged_split(20, 5, 0)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_fine_tunes_and_reports_seqeval_metrics(world, tmp_path, capsys, method):
    seqeval = pytest.importorskip("seqeval.metrics")
    run = tmp_path / method
    extra = ("finetune.method=lora", "finetune.r=4") if method == "lora" else ()
    assert main(["tag", *cli(world, run, *extra)]) == 0
    assert json.loads((run / "labels.json").read_text()) == TAGS
    saved = load_config(run / "config.yaml")
    assert (saved.model.score_head, saved.model.num_labels, saved.model.score_reads) == (True, 7, "token")
    records = read_metrics(run / "metrics.jsonl")
    assert all(np.isfinite(r["loss"]) and 0 <= r["accuracy"] <= 1 for r in records if "loss" in r)
    assert any("val_accuracy" in r for r in records)
    capsys.readouterr()
    assert main(["tag", "--report", "--set", f"run.dir={run}"]) == 0
    assert "entity precision" in capsys.readouterr().out
    report = json.loads(next(run.glob("tag_val_step_*.json")).read_text())
    # the report is seqeval's metrics of the run's own predictions on the validation words
    from lmforge.checkpoint.runs import run_config
    from lmforge.eval.open_run import build_run
    from lmforge.eval.span_metrics import tag_predictions

    cfg, source = run_config(run)
    truth, pred = tag_predictions(build_run(cfg, "eval", weights_from=source))
    names = lambda seqs: [[TAGS[k] for k in s] for s in seqs]  # noqa: E731
    t, p = names(truth), names(pred)
    assert report["words"] == sum(len(r["tokens"]) for r in _records(world.val))
    assert [len(s) for s in t] == [len(r["tokens"]) for r in _records(world.val)]
    assert t == [r["tags"] for r in _records(world.val)]  # every word's tag, in order
    assert report["accuracy"] == pytest.approx(seqeval.accuracy_score(t, p), abs=1e-12)
    assert report["entity_f1"] == pytest.approx(seqeval.f1_score(t, p), abs=1e-12)
    assert report["entity_precision"] == pytest.approx(seqeval.precision_score(t, p), abs=1e-12)
    assert report["entity_recall"] == pytest.approx(seqeval.recall_score(t, p), abs=1e-12)
    capsys.readouterr()
    assert main(["eval", "loss", str(run)]) == 0
    assert "accuracy" in capsys.readouterr().out


def test_resume_is_exact(world, tmp_path, capsys):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    extra = ("token_classify.class_weights=balanced",)
    assert main(["tag", *cli(world, straight, *extra)]) == 0
    with pytest.raises(Crash):
        Trainer(load_config(None, overrides(world, crashed, "objective.name=tag", *extra)),
                callbacks=[CrashAt(5)]).fit()
    assert main(["tag", *cli(world, crashed, *extra), "--resume"]) == 0
    keys = ("step", "loss", "accuracy", "grad_norm", "val_loss", "val_accuracy")
    curve = lambda d: [{k: r[k] for k in keys if k in r} for r in read_metrics(d / "metrics.jsonl")]  # noqa: E731
    assert curve(straight) == curve(crashed)
    assert json.loads((crashed / "labels.json").read_text()) == TAGS
    # resumed on data that maps the tags otherwise: refused, the run left as it was
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text("".join(json.dumps({**r, "tags": [t.lower() for t in r["tags"]]}) + "\n"
                               for r in _records(world.train)))
    before = (crashed / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["tag", *cli(world, crashed, *extra, f"token_classify.data=[{renamed}]",
                             "token_classify.val_data=[]", f"data.dir={tmp_path / 'other'}",
                             "train.max_steps=8"), "--resume"]) == 2
    assert "keeps its label map" in capsys.readouterr().err
    assert (crashed / "metrics.jsonl").read_text() == before


def test_subword_alignment_and_weighted_loss(world, tmp_path):
    from types import SimpleNamespace as NS

    from lmforge.checkpoint.runs import run_config, run_tokenizer_file
    from lmforge.data.labelled_tokens import TaggedBatch, TaggedRecord, encode_words
    from lmforge.data.tokenizer import Tokenizer
    from lmforge.engine.objectives.token_classify import TokenClassify

    tok = Tokenizer.load(run_tokenizer_file(run_config(world.base)[0]))
    words = ("count_words", "(", "zyxwvutsrq", ")")
    r = TaggedRecord(words, ("B-FUNC", "O", "B-VAR", "O"), "x.jsonl:1")
    ids, labels, cut = encode_words(tok, r, [0, 6, 4, 6], 64, None)
    pieces = tok.encode_batch([words[0], *(" " + w for w in words[1:])])
    assert ids.tolist() == [t for p in pieces for t in p] and not cut
    assert len(pieces[2]) > 1  # a rare word splits into sub-words: only its first carries the tag
    want = [x for p, t in zip(pieces, [0, 6, 4, 6]) for x in [t] + [-100] * (len(p) - 1)]
    assert labels.tolist() == want
    # an encoder reads [CLS] words [SEP], the specials carry no tag; words past seq_len are cut
    ids, labels, cut = encode_words(tok, r, [0, 6, 4, 6], len(pieces[0]) + len(pieces[1]) + 2,
                                    {"cls": 1, "sep": 2})
    assert ids.tolist() == [1, *pieces[0], *pieces[1], 2] and cut
    assert labels.tolist()[0] == labels.tolist()[-1] == -100

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = NS(arch="decoder", score_reads="token")
            self.emb, self.score = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3)

        def forward(self, ids, head):
            return head(self.emb(ids), None)

    model, weights = Stub(), [1.0, 2.0, 0.5]
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    labels = torch.tensor([[2, -100, 1, -100], [0, 1, -100, -100]])
    objective = TokenClassify(3, weights)
    out = objective(model, TaggedBatch(ids, torch.tensor([3, 2]), labels, 5))
    logits = model.score(model.emb(ids))
    keep = labels != -100
    want = torch.nn.functional.cross_entropy(logits[keep], labels[keep], weight=torch.tensor(weights),
                                             reduction="sum")
    assert float(out.loss) == pytest.approx(float(want), abs=1e-6)
    assert objective.num_targets(TaggedBatch(ids, torch.tensor([3, 2]), labels, 5)) == 4
    assert float(out.metrics["accuracy"]) == float((logits[keep].argmax(-1) == labels[keep]).sum())


def test_encoder_tags_words(world, tmp_path):
    """A masked-LM encoder fine-tuned as a tagger: [CLS] words [SEP], a per-token classifier (no pooler)."""
    mlm = tmp_path / "mlm"
    assert main(["train", "-c", str(Path(TINY).parents[1] / "mlm" / "tiny.yaml"),
                 *(a for o in tiny_overrides(mlm, tmp_path / "mlm-data", "train.max_steps=4",
                                             "checkpoint.every=0", "train.eval_every=0", "train.threads=1",
                                             "model.d_model=32", "model.n_layers=1")
                   for a in ("--set", o))]) == 0
    run = tmp_path / "enc"
    assert main(["tag", *cli(world, run, f"model.init_from={mlm}", "train.max_steps=3",
                                        "train.eval_every=3", "checkpoint.every=3")]) == 0
    from lmforge.data.task_data import load_task_data
    from lmforge.data.tokenizer import Tokenizer

    split = load_task_data(run / "data").split("train")
    enc = Tokenizer.load(run / "data" / "tokenizer.json").encoder_ids()
    first, labels = split.rows("ids", 0), split.rows("labels", 0)
    assert first[0] == enc["cls"] and first[-1] == enc["sep"] and labels[0] == labels[-1] == -100
    saved = load_config(run / "config.yaml")
    assert (saved.model.arch, saved.model.score_reads) == ("encoder", "token")
    from lmforge.checkpoint.runs import run_config
    from lmforge.eval.open_run import build_run

    model = build_run(*[run_config(run)[0]], "eval", weights_from=run_config(run)[1]).model
    assert not hasattr(model, "pooler") and model.score.bias is not None


BAD = {
    "length mismatch": ("train", {"tokens": ["x", "=", "1"], "tags": ["B-VAR", "O"]},
                        "3 words (tokens) but 2"),
    "unknown tag": ("val", {"tokens": ["x"], "tags": ["B-PER"]}, "unknown tag 'B-PER'"),
    "missing field": ("train", {"words": ["x"], "tags": ["O"]}, "field 'tokens' must be a non-empty list"),
    "index without names": ("train", {"tokens": ["x"], "tags": [3]}, "integer tags need token_classify"),
    "too many tags": ("train", {"tokens": ["x"], "tags": ["B-PER"]}, "more than token_classify.num_labels=7"),
    "empty word": ("train", {"tokens": ["x", " "], "tags": ["O", "O"]}, "word 1 ' ' must be a non-empty"),
    "not json": ("train", "{not json", "train.jsonl:4:"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_tag_files_exit_2_with_file_and_line(world, tmp_path, capsys, case):
    split, bad, message = BAD[case]
    good = _records(world.train if split == "train" else world.val)[:20]
    path = tmp_path / f"{split}.jsonl"
    rows = [json.dumps(r) if isinstance(r, dict) else r for r in [*good[:3], bad, *good[3:]]]
    path.write_text("".join(row + "\n" for row in rows))
    files = {"train": world.train, "val": world.val, split: path}
    run = tmp_path / "run"
    assert main(["tag", *cli(world, run, f"token_classify.data=[{files['train']}]",
                                        f"token_classify.val_data=[{files['val']}]")]) == 2
    err = capsys.readouterr().err
    assert f"{path}:4:" in err and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (run / "checkpoints").exists() and not (run / "data").exists()


def test_integer_tags_with_label_names_and_report_refusal(world, tmp_path, capsys):
    data = tmp_path / "ints.jsonl"
    data.write_text("".join(json.dumps({"tokens": r["tokens"], "ner_tags": [TAGS.index(t) for t in r["tags"]]
                                        }) + "\n" for r in _records(world.train)))
    run = tmp_path / "ints"
    names = "[" + ",".join(TAGS) + "]"
    assert main(["tag", *cli(world, run, f"token_classify.data=[{data}]",
                                        "token_classify.val_data=[]", "token_classify.tags_field=ner_tags",
                                        f"token_classify.label_names={names}", "train.max_steps=1",
                                        "checkpoint.every=0", "train.eval_every=0")]) == 0
    assert json.loads((run / "labels.json").read_text()) == TAGS
    # the export is transformers' token classifier, its labels named by the tag map
    assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForTokenClassification"]
    assert hf["id2label"] == {str(i): t for i, t in enumerate(TAGS)}
    assert main(["tag", "--report", "--set", f"run.dir={world.base}"]) == 2
    assert "not a tagger" in capsys.readouterr().err
