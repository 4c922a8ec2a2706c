"""Knowledge distillation end to end on the tiny recipe: a teacher run, students distilled from it on
the fly and from a precomputed top-k cache, the maths tied to plain training (kd_ratio 0 is causal LM
bit for bit), evaluation of a student, and the refusals (another tokenizer, a mismatched cache, options
that cannot work together), each a clear message and exit code 2."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import yaml

from conftest import TINY, tiny_overrides
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data.batch import TokenBatch
from lmforge.eval.open_run import evaluate
from lmforge.finetune.topk_cache import TopKCache
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import train


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny run trained for 30 steps and its prepared data dir (shared by the students)."""
    root = tmp_path_factory.mktemp("distill")
    train(load_config(TINY, tiny_overrides(root / "teacher", root / "data", "train.max_steps=30",
                                           "checkpoint.every=30")))
    return root


def _student(teacher, run, *extra):
    return tiny_overrides(run, teacher / "data", "train.max_steps=8", "train.eval_every=8",
                          "checkpoint.every=8", "model.n_layers=1", f"distill.teacher={teacher / 'teacher'}",
                          *extra)


def _cli(args):
    return main([a for arg in args for a in (("--set", arg) if "=" in arg else (arg,))])


def test_kd_ratio_zero_is_causal_lm_bit_for_bit(teacher, tmp_path):
    distilled = train(load_config(TINY, _student(teacher, tmp_path / "a", "objective.name=distill",
                                                 "distill.kd_ratio=0")))
    plain = train(load_config(TINY, _student(teacher, tmp_path / "b")))
    a = [r["loss"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "loss" in r]
    b = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "loss" in r]
    assert len(a) == 8 and a == b
    assert distilled["loss"] == plain["loss"]


def test_distilled_student_logs_both_parts_and_learns_the_teacher(teacher, tmp_path):
    run = tmp_path / "s"
    extra = ["distill.kd_ratio=1", "distill.temperature=2", "train.max_steps=20", "train.eval_every=20"]
    assert _cli(["distill", "-c", str(TINY), *_student(teacher, run, *extra)]) == 0
    records = read_metrics(run / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert all({"kd", "ce"} <= r.keys() for r in steps)
    # kd_ratio 1: the loss is the divergence alone (times T^2 = 4, summed per target)
    assert steps[0]["loss"] == pytest.approx(steps[0]["kd"], rel=1e-6)
    assert steps[-1]["kd"] < 0.5 * steps[0]["kd"]
    val = [r for r in records if "val_loss" in r][-1]
    # perplexity of the data's tokens (the reported val_ce mean is accumulated in float32: rel 1e-6)
    assert val["val_ppl"] == pytest.approx(math.exp(val["val_ce"]), rel=1e-6)
    assert val["val_ppl"] != pytest.approx(math.exp(val["val_loss"]), rel=1e-3)
    out = evaluate(run, ["eval.max_batches=2"], say=lambda *_: None)  # the teacher is loaded to evaluate
    assert {"kd", "ce"} <= out.keys() and out["ppl"] == pytest.approx(math.exp(out["ce"]), rel=1e-6)


def test_topk_cache_holds_the_teachers_logits_and_trains(teacher, tmp_path):
    cache = tmp_path / "cache"
    args = ["distill", "-c", str(TINY), *_student(teacher, tmp_path / "c", f"distill.topk_cache={cache}",
                                                  "distill.topk=8", "distill.temperature=1.5")]
    assert _cli([*args, "--precompute-topk"]) == 0
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["k"] == 8 and meta["seq_len"] == 64 and set(meta["files"]) == {"train", "val"}
    # a batch of real windows: the cache returns the teacher's top-8 of each row, in any order
    from lmforge.data.loader import TokenLoader
    from lmforge.data.prepare import prepare
    from lmforge.eval.open_run import load_run

    cfg = load_config(TINY, _student(teacher, tmp_path / "c"))
    data = prepare(cfg, console=lambda *_: None)
    batch = next(TokenLoader(data.shards("train"), 64, 4, seed=5).iter_eval_batches())
    batch = TokenBatch(batch.input_ids.flip(0), batch.targets.flip(0))
    got = TopKCache(cache, 64, 1.5, data.tokenizer, torch.device("cpu"))(batch)
    model = load_run(teacher / "teacher").model
    with torch.no_grad():
        logits = model(batch.input_ids).float()
    top = logits.topk(8, dim=-1)
    # The cache's forward ran on batches of another shape, so its logits may differ from these in the
    # last float32 bits (on some CPUs): compare at the precision the cache stores (float16 logits),
    # and the chosen tokens by their logits here (a near-tie may order two tokens either way).
    fp16 = dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got.logits, top.values, **fp16)
    torch.testing.assert_close(logits.gather(-1, got.ids.long()), top.values, **fp16)
    assert (got.ids.long() == top.indices).float().mean() > 0.99
    torch.testing.assert_close(got.lse, torch.logsumexp(logits / 1.5, -1), rtol=1e-5, atol=1e-5)
    assert _cli(args) == 0  # training reads the cache instead of the teacher
    steps = [r for r in read_metrics(tmp_path / "c" / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 8 and steps[-1]["kd"] < steps[0]["kd"]


def test_refusals(teacher, tmp_path, capsys):
    base = ["distill", "-c", str(TINY)]
    # another tokenizer: the teacher's vocabulary with two tokens' ids swapped
    other = tmp_path / "other"
    shutil.copytree(teacher / "teacher", other)
    cfg = yaml.safe_load((other / "config.yaml").read_text())
    tok = json.loads((teacher / "data" / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "otherdata").mkdir()
    (tmp_path / "otherdata" / "tokenizer.json").write_text(json.dumps(tok))
    cfg["data"]["dir"] = str(tmp_path / "otherdata")
    (other / "config.yaml").write_text(yaml.safe_dump(cfg))
    cases = [
        ([f"distill.teacher={other}"], "is not the student's"),
        (["distill.teacher=null"], "needs a teacher"),
        ([f"distill.teacher={tmp_path / 'missing'}"], "no such run"),
        (["model.vocab_size=576"], "model.vocab_size=512, the student 576"),
        (["train.loss_chunk_tokens=32"], "train.loss_chunk_tokens=0"),
        (["distill.loss=reverse_kl", f"distill.topk_cache={tmp_path}"], "forward KL only"),
        ([f"distill.topk_cache={tmp_path}"], "not a teacher top-k cache"),
    ]
    for i, (extra, message) in enumerate(cases):
        assert _cli([*base, *_student(teacher, tmp_path / f"r{i}", *extra)]) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (extra, err)
    cache = tmp_path / "cache"
    assert _cli([*base, *_student(teacher, tmp_path / "w", f"distill.topk_cache={cache}", "distill.topk=4"),
                 "--precompute-topk"]) == 0
    for extra, message in [(["train.seq_len=32"], "windows of 64 tokens"),
                           (["distill.temperature=2"], "distill.temperature=1.0")]:
        assert _cli([*base, *_student(teacher, tmp_path / "x", f"distill.topk_cache={cache}", *extra)]) == 2
        assert message in capsys.readouterr().err


def test_a_quantized_teacher(teacher, tmp_path):
    """distill.teacher may be a run `lmforge quantize` wrote: it loads with its int8 layers and teaches."""
    q = tmp_path / "teacher-int8"
    assert main(["quantize", str(teacher / "teacher"), str(q), "--bits", "8"]) == 0
    run = tmp_path / "q"
    assert _cli(["distill", "-c", str(TINY), *_student(teacher, run, f"distill.teacher={q}",
                                                       "train.max_steps=3", "train.eval_every=3")]) == 0
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 3 and all(r["kd"] > 0 for r in steps)
