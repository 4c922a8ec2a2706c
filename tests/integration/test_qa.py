"""`lmforge qa` end to end on the shipped question set (`lmforge tasks --qa`): a tiny pretrained decoder
fine-tuned fully and with LoRA, `lmforge qa --report` (exact match and F1 of the run's own best spans),
exact resume, an encoder reader, the windows of a long context (doc stride, answer positions, position 0
where a window lacks the answer), the loss, and bad records refused with their file and line."""

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


@pytest.fixture(scope="module")
def world(tmp_path_factory, shared_data_dir) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("qa")
    base = tmp / "base"
    train(load_config(TINY, tiny_overrides(base, shared_data_dir, "train.max_steps=30", "checkpoint.every=0",
                                           "train.eval_every=0")))
    assert main(["tasks", "--qa", "-o", str(tmp / "train.jsonl"), "--test-out", str(tmp / "val.jsonl"),
                 "--n", "120", "--n-test", "24"]) == 0
    return SimpleNamespace(tmp=tmp, base=base, train=tmp / "train.jsonl", val=tmp / "val.jsonl")


def overrides(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [f"model.init_from={w.base}", f"qa.data=[{w.train}]", f"qa.val_data=[{w.val}]",
            f"run.dir={run_dir}", "train.max_steps=6", "train.micro_batch_size=8", "train.grad_accum_steps=2",
            "train.precision=fp32", "train.threads=1", "train.log_every=1", "train.eval_every=3",
            "train.eval_batches=8",
            "checkpoint.every=3", "checkpoint.keep_last=3", "optim.lr=3e-3", "schedule.warmup_steps=1",
            "logging.progress=none", *extra]


def cli(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [a for o in overrides(w, run_dir, *extra) for a in ("--set", o)]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_shipped_set_is_seeded_disjoint_and_points_at_its_answers(world):
    from lmforge.data.qa_tasks import qa_split

    train_recs, val_recs = _records(world.train), _records(world.val)
    assert (train_recs, val_recs) == tuple(map(list, qa_split(120, 24, 0)))
    assert not {r["context"] for r in train_recs} & {r["context"] for r in val_recs}
    for r in train_recs + val_recs:
        (text,), (start,) = r["answers"]["text"], r["answers"]["answer_start"]
        assert r["context"][start:start + len(text)] == text
    assert qa_split(10, 4, 1) != qa_split(10, 4, 0)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_fine_tunes_and_reports_exact_match_and_f1(world, tmp_path, capsys, method):
    run = tmp_path / method
    extra = ("finetune.method=lora", "finetune.r=4") if method == "lora" else ()
    assert main(["qa", *cli(world, run, *extra)]) == 0
    saved = load_config(run / "config.yaml")
    assert (saved.model.score_head, saved.model.num_labels, saved.model.score_reads) == (True, 2, "span")
    records = read_metrics(run / "metrics.jsonl")
    assert all(np.isfinite(r["loss"]) and 0 <= r["span_accuracy"] <= 1 for r in records if "loss" in r)
    assert any("val_span_accuracy" in r for r in records)
    capsys.readouterr()
    assert main(["qa", "--report", "--set", f"run.dir={run}", "--set", "eval.max_batches=null"]) == 0
    assert "exact match" in capsys.readouterr().out
    report = json.loads(next(run.glob("qa_val_step_*.json")).read_text())
    from lmforge.checkpoint.runs import run_config
    from lmforge.eval.open_run import build_run
    from lmforge.eval.span_metrics import qa_predictions, squad_exact, squad_f1

    cfg, source = run_config(run, ["eval.max_batches=null"])
    preds, golds = qa_predictions(build_run(cfg, "eval", weights_from=source), "val")
    assert report["questions"] == len(preds) == 24
    assert golds == [r["answers"]["text"] for r in _records(world.val)]
    contexts = [r["context"] for r in _records(world.val)]
    assert all(p in c for p, c in zip(preds, contexts))  # every prediction is a span of its context
    pairs = list(zip(preds, golds))
    assert report["exact_match"] == pytest.approx(100 * np.mean([squad_exact(p, g[0]) for p, g in pairs]))
    assert report["f1"] == pytest.approx(100 * np.mean([squad_f1(p, g[0]) for p, g in pairs]))


def test_resume_is_exact(world, tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert main(["qa", *cli(world, straight)]) == 0
    with pytest.raises(Crash):
        Trainer(load_config(None, overrides(world, crashed, "objective.name=qa")),
                callbacks=[CrashAt(5)]).fit()
    assert main(["qa", *cli(world, crashed), "--resume"]) == 0
    keys = ("step", "loss", "span_accuracy", "grad_norm", "val_loss", "val_span_accuracy")
    curve = lambda d: [{k: r[k] for k in keys if k in r} for r in read_metrics(d / "metrics.jsonl")]  # noqa: E731
    assert curve(straight) == curve(crashed)


def _tok(world):
    from lmforge.checkpoint.runs import run_config, run_tokenizer_file
    from lmforge.data.tokenizer import Tokenizer

    return Tokenizer.load(run_tokenizer_file(run_config(world.base)[0]))


def test_windows_of_a_long_context(world):
    from lmforge.config.qa import QAConfig
    from lmforge.data.squad import QARecord, windows

    tok = _tok(world)
    context = " ".join(f"word{i}" for i in range(60)) + " the answer is here " + " tail" * 40
    start = context.index("answer is")
    r = QARecord(context, "Where is it?", ("answer is",), (start,), "x.jsonl:1")
    c = QAConfig(doc_stride=8, max_windows=64)
    ws, cut = windows(tok, r, c, 48, None)
    ctx = tok.hf.encode(context, add_special_tokens=False)
    prefix = tok.encode("Where is it?\n")
    room = 48 - len(prefix)
    assert not cut and len(ws) > 3
    begin = 0
    for w in ws:  # each window: the question, then the next stretch, doc_stride tokens shared with the last
        assert w.ids[: len(prefix)] == prefix and w.second == len(prefix) and len(w.ids) <= 48
        assert w.ids[len(prefix):] == ctx.ids[begin: begin + room]
        begin += room - 8
    holding = [w for w in ws if w.end]
    assert holding and all(w.start == w.end == 0 for w in ws if w not in holding)
    for w in holding:  # the target tokens' characters are the answer's (with a leading space at most)
        assert context[w.spans[w.start][0]: w.spans[w.end][1]].strip() == "answer is"
    few, cut = windows(tok, r, QAConfig(doc_stride=8, max_windows=2), 48, None)
    assert len(few) == 2 and cut
    # an encoder: [CLS] question [SEP] context [SEP]
    enc, _ = windows(tok, r, c, 48, {"cls": 1, "sep": 2})
    q = tok.encode("Where is it?")
    assert enc[0].ids[: len(q) + 2] == [1, *q, 2] and enc[0].ids[-1] == 2 and enc[0].second == len(q) + 2


def test_loss_is_transformers_qa_loss_with_padding_excluded():
    from types import SimpleNamespace as NS

    from lmforge.data.squad import SpanBatch
    from lmforge.engine.objectives.qa import QA

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cfg = NS(arch="decoder", score_reads="span")
            self.emb, self.score = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2)

        def forward(self, ids, head):
            return head(self.emb(ids), None)

    model = Stub()
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])
    batch = SpanBatch(ids, torch.tensor([4, 2]), torch.tensor([2, 0]), torch.tensor([3, 1]), 6)
    out = QA()(model, batch)
    want = 0.0
    for row, n in ((0, 4), (1, 2)):  # each row alone, as transformers computes it on an unpadded row
        logits = model.score(model.emb(ids[row, :n]))
        want += (torch.nn.functional.cross_entropy(logits[:, 0], batch.start[row])
                 + torch.nn.functional.cross_entropy(logits[:, 1], batch.end[row])) / 2
    assert float(out.loss) == pytest.approx(float(want), abs=1e-6)


def test_encoder_reads_questions(world, tmp_path):
    mlm = tmp_path / "mlm"
    assert main(["train", "-c", str(Path(TINY).parents[1] / "mlm" / "tiny.yaml"),
                 *(a for o in tiny_overrides(mlm, tmp_path / "mlm-data", "train.max_steps=4",
                                             "checkpoint.every=0", "train.eval_every=0", "train.threads=1",
                                             "model.d_model=32", "model.n_layers=1")
                   for a in ("--set", o))]) == 0
    run = tmp_path / "enc"
    assert main(["qa", *cli(world, run, f"model.init_from={mlm}", "train.max_steps=3", "train.eval_every=3",
                            "checkpoint.every=3")]) == 0
    saved = load_config(run / "config.yaml")
    assert (saved.model.arch, saved.model.score_reads) == ("encoder", "span")
    assert main(["qa", "--report", "--set", f"run.dir={run}"]) == 0
    assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["BertForQuestionAnswering"]


Q = {"context": "import os", "question": "Which?"}
BAD = {
    "start off": {**Q, "answers": {"text": ["os"], "answer_start": [2]}},
    "no answers": {**Q, "answers": {"text": [], "answer_start": []}},
    "missing context": {"question": "Which?", "answers": {"text": ["os"], "answer_start": [7]}},
    "lengths": {**Q, "answers": {"text": ["os"], "answer_start": []}},
}
MESSAGES = {"start off": "answer_start 2 does not point at it", "no answers": "at least one",
            "missing context": "field 'context' must be a non-empty string", "lengths": "as many starts"}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_records_exit_2_with_file_and_line(world, tmp_path, capsys, case):
    good = _records(world.train)[:20]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*good[:3], BAD[case], *good[3:]]))
    run = tmp_path / "run"
    assert main(["qa", *cli(world, run, f"qa.data=[{path}]")]) == 2
    err = capsys.readouterr().err
    assert f"{path}:4:" in err and MESSAGES[case] in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (run / "checkpoints").exists() and not (run / "data").exists()
    assert main(["qa", "--report", "--set", f"run.dir={world.base}"]) == 2
    assert "not a question answerer" in capsys.readouterr().err


def test_parquet_records_read_as_jsonl(world, tmp_path):
    """SQuAD on the Hub is Parquet: an answers struct of lists arrives as arrays, read like JSON lists;
    tagged words likewise (list columns)."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    from lmforge.config.qa import QAConfig
    from lmforge.config.token_classify import TokenClassifyConfig
    from lmforge.data.chat import ChatStats, iter_records
    from lmforge.data.labelled_tokens import parse_tagged
    from lmforge.data.squad import parse_qa

    recs = _records(world.train)[:5]
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.Table.from_pylist(recs), path)
    (_, rows), = iter_records(path, ChatStats())
    parsed = [parse_qa(r, w, QAConfig()) for w, r in rows]
    assert [(p.context, p.question, list(p.answers), list(p.starts)) for p in parsed] == [
        (r["context"], r["question"], r["answers"]["text"], r["answers"]["answer_start"]) for r in recs]
    tagged = [{"tokens": ["x", "=", "1"], "tags": ["B-VAR", "O", "B-NUM"]}]
    path = tmp_path / "tags.parquet"
    pq.write_table(pa.Table.from_pylist(tagged), path)
    (_, rows), = iter_records(path, ChatStats())
    (where, row), = list(rows)
    got = parse_tagged(row, where, TokenClassifyConfig())
    assert (list(got.words), list(got.tags)) == (tagged[0]["tokens"], tagged[0]["tags"])


def test_tasks_writes_one_shipped_set_at_a_time(tmp_path, capsys):
    assert main(["tasks", "--qa", "--tagged", "-o", str(tmp_path / "x.jsonl")]) == 2
    assert "give one of --tagged / --qa" in capsys.readouterr().err
    assert main(["tasks", "--qa"]) == 2
    assert "--qa writes its training records to -o/--out" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
