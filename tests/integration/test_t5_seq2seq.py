"""Seq2seq fine-tuning of the T5 encoder-decoder (objective seq2seq, what `lmforge sft` trains on a T5
model): the loss equals transformers' T5ForConditionalGeneration loss with `labels=` on a padded batch,
`lmforge tasks` chat records and plain {input, target} records map to input -> target (other shapes
refused with file:line), overlong records are cut or dropped, `lmforge sft` from a span-corruption run
trains (loss falls), a crashed run resumes bit for bit, and the sft section's keys are refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import CORPUS, Crash, CrashAt
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data.batch import IGNORE_INDEX
from lmforge.data.seq2seq import Seq2SeqBatch
from lmforge.data.seq2seq_data import read_pairs
from lmforge.engine.objectives.seq2seq import Seq2Seq
from lmforge.errors import DataError
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, train

T5_TINY = Path(__file__).resolve().parents[2] / "configs" / "t5" / "tiny.yaml"
COMPARED = ("step", "loss", "accuracy", "grad_norm", "lr", "val_loss", "val_accuracy")


def test_loss_equals_transformers_with_labels(tmp_path):
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
    from test_t5_hf import V, hf_model

    from lmforge.models.hf import from_hf

    hf = hf_model("v1_1")
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, V, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 9:] = 0
    targets = torch.randint(2, V, (3, 7), generator=g)
    targets[0, 4:] = IGNORE_INDEX  # right-padded targets: no loss, decoder reads the start (pad) token
    targets[2, 6:] = IGNORE_INDEX
    batch = Seq2SeqBatch(torch.where(mask.bool(), ids, 0), targets, mask)
    with torch.no_grad():
        out = Seq2Seq(decoder_start=0)(ours, batch)
        want = hf(input_ids=batch.input_ids, attention_mask=mask, labels=targets).loss
    assert isinstance(hf, transformers.T5ForConditionalGeneration)
    torch.testing.assert_close(out.loss / batch.target_count(), want, atol=1e-5, rtol=0)
    assert batch.target_count() == 3 * 7 - 3 - 1
    assert batch.num_tokens == int(mask.sum()) + batch.target_count()  # throughput: no padding counted


def _write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _section(**kw):
    from lmforge.config.seq2seq import Seq2SeqConfig

    return Seq2SeqConfig(**kw)


def test_records_map_to_input_and_target(tmp_path):
    f = _write(tmp_path / "r.jsonl", [
        {"messages": [{"role": "user", "content": "What is 4 + 2?"}, {"role": "assistant", "content": "6"}],
         "task": "add", "answer": "6"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}]},
        {"prompt": "p", "completion": "c"},
        {"src": "the cat", "dst": "le chat"}])
    pairs = list(read_pairs([str(f)], _section(input_field="src", target_field="dst")))
    assert [(p.input, p.target) for p in pairs] == [
        ("What is 4 + 2?", "6"), ("Be brief.\n\nhi", "hello"), ("p", "c"), ("the cat", "le chat")]
    assert pairs[1].where == f"{f}:2"
    with pytest.raises(DataError, match=rf"{f}:2: the record has a system prompt and seq2seq.system=refuse"):
        list(read_pairs([str(f)], _section(input_field="src", target_field="dst", system="refuse")))


def test_parquet_records_with_named_fields(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["2 + 2", "3 + 1"], "reply": ["4", "4!"], "extra": [1, 2]}),
                   tmp_path / "r.parquet")
    pairs = list(read_pairs([str(tmp_path)], _section(input_field="question", target_field="reply")))
    assert [(p.input, p.target) for p in pairs] == [("2 + 2", "4"), ("3 + 1", "4!")]


@pytest.mark.parametrize(("record", "message"), [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
     "this record's turns are user, assistant, user, assistant"),
    ({"input": "x"}, "field 'target' must be a non-empty string, got missing; seq2seq.target_field"),
    ({"input": "x", "target": 3}, "field 'target' must be a non-empty string, got int"),
    ({"text": "plain text"}, "a seq2seq record is either plain"),
    ([1, 2], "a seq2seq record must be a JSON object"),
])
def test_bad_records_name_file_and_line(tmp_path, record, message):
    ok = {"input": "a", "target": "b"}
    f = _write(tmp_path / "r.jsonl", [ok, record])
    with pytest.raises(DataError, match=rf"^{f}:2: .*{message}"):
        list(read_pairs([str(f)], _section()))


def test_bad_field_settings_are_refused():
    with pytest.raises(ValueError, match="seq2seq.input_field and seq2seq.target_field are both 'x'"):
        _section(input_field="x", target_field="x")


# -- end to end: span-corruption pretraining, then `lmforge sft` -----------------------------------------
@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("t5seq")
    cfg = load_config(T5_TINY, [f"run.dir={root / 'pre'}", f"data.dir={root / 'data'}",
                                f"data.sources=[{CORPUS}]", "data.max_chars=300000",
                                "data.tokenizer.train_chars=200000",
                                "logging.progress=none", "logging.plot=false", "train.max_steps=4",
                                "checkpoint.every=0", "train.eval_every=0"])
    train(cfg)
    assert main(["tasks", "--tasks", "add,reverse", "-o", str(root / "tasks.jsonl"), "--n", "120",
                 "--seed", "3"]) == 0
    return root


def sft_config(root: Path, run: Path, *extra: str) -> Path:
    path = run.parent / f"{run.name}.yaml"
    path.write_text(f"""run: {{dir: {run}, seed: 5}}
model: {{init_from: {root / 'pre'}}}
seq2seq: {{data: [{root / 'tasks.jsonl'}], val_fraction: 0.1}}
optim: {{lr: 3.0e-3}}
schedule: {{warmup_steps: 2}}
train: {{max_steps: 12, micro_batch_size: 8, seq_len: 32, log_every: 1, eval_every: 6, eval_batches: 2,
         precision: fp32, threads: 1}}
checkpoint: {{every: 5}}
logging: {{progress: none, plot: false}}
""")
    return path


def curve(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in COMPARED if k in r} for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def finetuned(pretrained) -> Path:
    run = pretrained / "sft"
    assert main(["sft", "-c", str(sft_config(pretrained, run))]) == 0
    return run


def test_lmforge_sft_on_t5_trains_and_resumes_bit_for_bit(pretrained, finetuned, tmp_path):
    saved = (finetuned / "config.yaml").read_text()
    assert "name: seq2seq" in saved and "arch: t5" in saved
    rows = [r for r in read_metrics(finetuned / "metrics.jsonl") if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5  # the targets are learnt
    crashed = tmp_path / "crashed"
    # in Python the method is named (lmforge sft names it from the model), with the architecture it needs
    cfg = load_config(sft_config(pretrained, crashed), ["objective.name=seq2seq", "model.arch=t5"])
    with pytest.raises(Crash):
        Trainer(cfg, callbacks=[CrashAt(7)]).fit()
    assert main(["sft", "-c", str(sft_config(pretrained, crashed)), "--resume"]) == 0
    a, b = curve(finetuned), curve(crashed)
    assert [r["step"] for r in a] == [r["step"] for r in b] and any("val_loss" in r for r in a)
    assert a == b


def test_eval_loss_and_exact_match_of_a_t5_run(finetuned, tmp_path):
    from lmforge.data.instruct_tasks import extract_answer
    from lmforge.eval.open_run import eval_tasks, evaluate, generate_text

    vals = [r for r in read_metrics(finetuned / "metrics.jsonl") if "val_loss" in r]
    report = evaluate(finetuned, ["eval.max_batches=2"], say=lambda *_: None)
    assert report["loss"] == pytest.approx(vals[-1]["val_loss"], rel=1e-5)
    # exact match: batched, padded greedy outputs scored against answers; two answers are what the model
    # writes for its prompt alone (lmforge generate), the third is not
    prompts = ["Reverse the letters: abc", "What is 4 + 2?", "Reverse the letters: a long word list here"]
    alone = [generate_text(finetuned, [f"generate.prompt='{p}'", "generate.temperature=0",
                                       "generate.max_new_tokens=24"])[0] for p in prompts]
    answers = [extract_answer(alone[0]), extract_answer(alone[1]), "certainly not this ###"]
    records = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}],
                "task": "reverse", "answer": a} for p, a in zip(prompts, answers)]
    tasks = _write(tmp_path / "test.jsonl", records)
    assert eval_tasks(finetuned, tasks, batch_size=3) == {"reverse": (2, 3)}
    assert eval_tasks(finetuned, tasks, batch_size=1) == {"reverse": (2, 3)}
    # generate --chat: the prompt is the user's turn, which is the input text (no chat template)
    chat = generate_text(finetuned, [f"generate.prompt='{prompts[2]}'", "generate.temperature=0",
                                     "generate.max_new_tokens=24"], chat=True)
    assert chat == [alone[2]]


@pytest.mark.parametrize(("extra", "message"), [
    (["--set", "sft.packing=true"], "reads the seq2seq section, not sft.packing"),
    (["--set", "seq2seq.data=[]"], "objective seq2seq needs input -> target records"),
    (["--budget", "1m"], "on this model lmforge sft trains objective seq2seq, which has no planner yet"),
])
def test_what_seq2seq_refuses_exits_2(pretrained, tmp_path, capsys, extra, message):
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["sft", "-c", str(sft_config(pretrained, run)), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (run / "checkpoints").exists()


def test_overlong_records_are_cut_or_dropped(pretrained, tmp_path):
    from lmforge.data.seq2seq_data import prepare

    long = {"input": "word " * 80, "target": "answer " * 80}
    f = _write(tmp_path / "r.jsonl", [{"input": "a b", "target": "c"}, long])
    for overlong, examples in (("truncate", 2), ("drop", 1)):
        cfg = load_config(sft_config(pretrained, tmp_path / overlong), [
            "objective.name=seq2seq", f"seq2seq.data=[{f}]", "seq2seq.val_fraction=0", "model.arch=t5",
            f"seq2seq.overlong={overlong}", f"data.tokenizer.path={pretrained / 'data' / 'tokenizer.json'}",
            "model.max_seq_len=64", "model.init_from=null"])
        data = prepare(cfg, console=lambda *_: None)
        split = data.split("train")
        assert len(split) == examples and data.meta["splits"]["train"][
            "truncated" if overlong == "truncate" else "dropped"] == 1
        eos = data.tokenizer.eos_id
        if overlong == "truncate":
            assert int(split.lengths[1]) == 32 and int(split.ids[split.offsets[2] - 1]) == eos
            assert int(split.target_offsets[2] - split.target_offsets[1]) == 64
