"""The SDK's training controls: train.sanity_check=overfit_one_batch, optim.param_groups through a run
and its resume, Trainer.adjust_learning_rate and Trainer.train_epochs. Runs are a user's small module
on byte documents (seconds each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import lmforge
from lmforge.errors import CheckpointMismatchError
from lmforge.metrics.loggers import read_metrics
from lmforge.train.sanity import SanityCheckFailed

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "data" / "pydoc_topics.jsonl"
TINY = REPO / "configs" / "debug" / "tiny.yaml"


class GRULM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(ids))[0])  # (B, T, vocab)


def byte_docs(n: int = 40) -> list[list[int]]:
    rows = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()][:n]
    return [list(t.encode()) for t in rows]


def config(run_dir: Path, lr: float | None = 1e-2, optim: dict | None = None, **train) -> dict:
    return {
        "run": {"dir": str(run_dir)},
        "optim": {**({"lr": lr} if lr is not None else {}), **(optim or {})},
        "schedule": {"name": "cosine", "warmup_steps": 2},
        "train": {"max_steps": 6, "seq_len": 32, "micro_batch_size": 4, "precision": "fp32", "log_every": 1,
                  "eval_every": 0, "threads": 1, **train},
        "checkpoint": {"every": 0},
        "logging": {"progress": "none", "plot": False},
    }


def trainer(run_dir: Path, resume: bool = False, callbacks=(), optimizer=None, **kw) -> lmforge.Trainer:
    torch.manual_seed(0)
    return lmforge.Trainer(model=GRULM(), train_data=byte_docs(), config=config(run_dir, **kw), resume=resume,
                           callbacks=callbacks, optimizer=optimizer)


def losses(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["lr"]) for r in read_metrics(run_dir / "metrics.jsonl")
            if "loss" in r and "event" not in r]


# -- train.sanity_check -------------------------------------------------------------------------

def test_a_passing_sanity_check_leaves_the_run_as_it_would_be(tmp_path):
    """With the check the run takes exactly the steps of the run without it (weights, optimizer, data
    position and RNG restored), and the check's verdict is in metrics.jsonl."""
    checked = trainer(tmp_path / "a", sanity_check="overfit_one_batch", sanity_steps=30)
    checked.fit()
    plain = trainer(tmp_path / "b")
    plain.fit()
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    for p, q in zip(checked.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(p, q)
    event = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if r.get("event") == "sanity_check"]
    assert len(event) == 1 and event[0]["steps"] == 30 and event[0]["ratio"] < 0.5


def test_a_failing_sanity_check_names_the_likely_cause(tmp_path):
    t = trainer(tmp_path / "low", lr=1e-6, sanity_check="overfit_one_batch", sanity_steps=10)
    expected = (r"10 steps on one batch took the loss from .* it must fall below train.sanity_loss_ratio=0.5"
                r".*lr may be too low \(optim.lr=1e-06")
    with pytest.raises(SanityCheckFailed, match=expected):
        t.fit()
    assert t.step == 0 and not (tmp_path / "low" / "checkpoints").exists()
    high = trainer(tmp_path / "high", lr=30.0, sanity_check="overfit_one_batch", sanity_steps=10,
                   grad_clip=0.0)
    with pytest.raises(SanityCheckFailed, match=r"lr is (likely )?too high|became NaN"):
        high.fit()


def test_the_cli_exits_2_on_a_failed_sanity_check(tmp_path, shared_data_dir, capsys):
    from lmforge.cli import main

    sets = [f"run.dir={tmp_path / 'r'}", f"data.dir={shared_data_dir}", f"data.sources=[{CORPUS}]",
            "data.max_chars=null", "logging.progress=none", "optim.lr=1e-7",
            "train.sanity_check=overfit_one_batch", "train.sanity_steps=5"]
    assert main(["train", "-c", str(TINY), *sum((["--set", s] for s in sets), [])]) == 2
    err = capsys.readouterr().err
    assert "lmforge train: error: train.sanity_check=overfit_one_batch failed" in err
    assert "Traceback" not in err


# -- optim.param_groups through a run -----------------------------------------------------------

RULES = [{"match": "emb.*", "lr_scale": 0.1}, {"match": "head.bias", "weight_decay": 0.0, "lr_scale": 2.0}]


def test_param_group_rules_train_resume_and_refuse_other_groups(tmp_path):
    """A run with rules crashed and resumed equals the uninterrupted run; resuming it with other rules is
    refused with the groups named, and the run dir is left as it was."""
    straight = trainer(tmp_path / "s", optim={"param_groups": RULES})
    straight.fit()
    names = [g["name"] for g in straight.optimizer.param_groups]
    assert names == ["decay", "no_decay", "rule0_no_decay", "rule1_no_decay"]

    class Stop(Exception):
        pass

    class CrashAt3(lmforge.Callback):
        def on_step_end(self, trainer, step, result):
            if step == 3:
                trainer.save()
                raise Stop

    with pytest.raises(Stop):
        trainer(tmp_path / "c", optim={"param_groups": RULES}, callbacks=[CrashAt3()]).fit()
    before = sorted(p.name for p in (tmp_path / "c" / "checkpoints").iterdir())
    with pytest.raises(CheckpointMismatchError, match=r"rule0_no_decay.*optim.param_groups"):
        trainer(tmp_path / "c", resume=True, optim={"param_groups": RULES[:1]})
    assert sorted(p.name for p in (tmp_path / "c" / "checkpoints").iterdir()) == before
    trainer(tmp_path / "c", resume=True, optim={"param_groups": RULES}).fit()
    assert losses(tmp_path / "c")[-3:] == losses(tmp_path / "s")[-3:]


# -- Trainer.train_epochs and Trainer.adjust_learning_rate --------------------------------------

def small_trainer(run_dir: Path, resume: bool = False, **kw) -> lmforge.Trainer:
    """Three batches per pass over the data: epochs of three steps."""
    torch.manual_seed(0)
    cfg = config(run_dir, **{"max_steps": 10, **kw})
    return lmforge.Trainer(model=GRULM(), train_data=[byte_docs(1)[0][:400]], config=cfg, resume=resume)


def test_train_epochs_yields_each_pass_and_takes_fits_steps(tmp_path):
    t = small_trainer(tmp_path / "e")
    per_epoch = t.run.train_loader.batches_per_epoch
    assert per_epoch == 3
    summaries = list(t.train_epochs())
    assert [(s["epoch"], s["steps"], s["step"], s["complete"]) for s in summaries] == [
        (1, 3, 3, True), (2, 3, 6, True), (3, 3, 9, True), (4, 1, 10, False)]
    assert all(s["tokens"] == s["steps"] * 4 * 32 for s in summaries)
    logged = losses(tmp_path / "e")
    for s in summaries:
        in_epoch = [loss for step, loss, _ in logged if s["step"] - s["steps"] < step <= s["step"]]
        assert s["loss"] == pytest.approx(sum(in_epoch) / len(in_epoch), rel=1e-12)
    small_trainer(tmp_path / "f").fit()
    assert logged == losses(tmp_path / "f")
    assert (tmp_path / "e" / "checkpoints" / "step_00000010").is_dir()  # ended as fit ends


def test_stopping_between_epochs_checkpoints_and_resume_continues_exactly(tmp_path):
    """A caller that breaks after epoch 2 leaves a checkpoint at that step; resumed, the run takes the
    uninterrupted run's steps; an lr adjustment made between epochs is saved with it and kept."""
    t = small_trainer(tmp_path / "s")
    for summary in t.train_epochs():
        t.adjust_learning_rate(0.5)
        if summary["epoch"] == 2:
            break
    assert (tmp_path / "s" / "checkpoints" / "step_00000006").is_dir()
    resumed = small_trainer(tmp_path / "s", resume=True)
    assert resumed.step == 6 and resumed.lr_scale == 0.25
    resumed.fit()

    ref = small_trainer(tmp_path / "r")
    for summary in ref.train_epochs():
        ref.adjust_learning_rate(0.5 if summary["epoch"] <= 2 else 1.0)
    assert losses(tmp_path / "s") == losses(tmp_path / "r")
    plain = small_trainer(tmp_path / "p")
    plain.fit()
    scaled = {step: lr for step, _, lr in losses(tmp_path / "r")}
    for step, _, lr in losses(tmp_path / "p"):
        factor = 1.0 if step <= 3 else 0.5 if step <= 6 else 0.25
        assert scaled[step] == pytest.approx(lr * factor, rel=1e-12), step


@pytest.mark.parametrize("factor", [0, -1.0, float("nan"), float("inf"), True, "0.5"])
def test_adjust_learning_rate_refuses_what_is_not_a_positive_number(tmp_path, factor):
    t = small_trainer(tmp_path / "x")
    with pytest.raises(ValueError, match="factor must be a positive finite number"):
        t.adjust_learning_rate(factor)
    assert t.lr_scale == 1.0
    t.run.release()


# -- Trainer(optimizer=..., param_groups=...) ---------------------------------------------------

def test_a_factory_gets_lmforges_groups_and_equals_lmforges_own_optimizer(tmp_path):
    """optimizer=<factory> is called with the param groups lmforge would use: AdamW built by the user over
    them takes exactly the steps of the configured AdamW."""
    def adamw(groups):
        return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)

    user = trainer(tmp_path / "u", optimizer=adamw, lr=None)
    assert [g["name"] for g in user.optimizer.param_groups] == ["decay", "no_decay"]
    user.fit()
    trainer(tmp_path / "o").fit()
    assert losses(tmp_path / "u") == losses(tmp_path / "o")


def test_an_optimizer_instance_trains_checkpoints_and_resumes_exactly(tmp_path):
    """A torch optimizer of the user's (RMSprop: nothing lmforge has) is the one that steps; its state goes
    through the checkpoint, so a crashed run resumed with a fresh instance takes the uninterrupted steps."""
    def run(run_dir: Path, resume: bool = False, callbacks=()) -> lmforge.Trainer:
        torch.manual_seed(0)
        model = GRULM()
        opt = torch.optim.RMSprop(model.parameters(), lr=3e-3, momentum=0.5)
        t = lmforge.Trainer(model=model, train_data=byte_docs(), config=config(run_dir, lr=None),
                            resume=resume, callbacks=callbacks, optimizer=opt)
        assert t.optimizer is opt
        return t

    run(tmp_path / "s").fit()

    class Stop(Exception):
        pass

    class CrashAt3(lmforge.Callback):
        def on_step_end(self, trainer, step, result):
            if step == 3:
                trainer.save()
                raise Stop

    with pytest.raises(Stop):
        run(tmp_path / "c", callbacks=[CrashAt3()]).fit()
    resumed = run(tmp_path / "c", resume=True)
    assert resumed.optimizer.state  # the momentum buffers came back
    resumed.fit()
    assert losses(tmp_path / "c") == losses(tmp_path / "s")
    # the logged lr is the optimizer's, warming up
    assert [lr for _, _, lr in losses(tmp_path / "s")][:3] == [0.0, 3e-3 / 2, 3e-3]


def test_param_groups_of_the_user_equal_the_same_groups_by_rule(tmp_path):
    torch.manual_seed(0)
    model = GRULM()
    rest = [p for n, p in model.named_parameters() if not n.startswith("emb.")]
    decay = [p for p in rest if p.ndim >= 2]
    groups = [{"params": decay, "name": "decay"},
              {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
              {"params": [model.emb.weight], "weight_decay": 0.0, "lr_scale": 0.1}]
    mine = lmforge.Trainer(model=model, train_data=byte_docs(), config=config(tmp_path / "m"),
                           param_groups=groups)
    assert [g["name"] for g in mine.optimizer.param_groups] == ["decay", "group1", "group2"]
    assert mine.optimizer.param_groups[0]["weight_decay"] == 0.1  # optim.weight_decay's default
    mine.fit()
    trainer(tmp_path / "r", optim={"param_groups": [{"match": "emb.*", "lr_scale": 0.1}]}).fit()
    assert losses(tmp_path / "m") == losses(tmp_path / "r")


def test_user_optimizers_are_refused_where_they_cannot_be_honoured(tmp_path):
    from types import SimpleNamespace

    from lmforge.assembly.checks import check_user_optimizer
    from lmforge.errors import ConfigError
    from lmforge.optim.builder import UserOptimizer

    def refused(match: str, **kw) -> None:
        torch.manual_seed(0)
        model = kw.pop("model", GRULM())
        cfg = kw.pop("cfg", config(tmp_path / "x", lr=None))
        with pytest.raises(ConfigError, match=match):
            lmforge.Trainer(model=model, train_data=byte_docs(), config=cfg, **kw)
        assert not (tmp_path / "x" / "checkpoints").exists()

    model, other = GRULM(), GRULM()
    refused("not the trained model's", model=model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    refused(r"in no group would never train: head.weight, head.bias", model=model,
            optimizer=torch.optim.SGD([*model.emb.parameters(), *model.rnn.parameters()], lr=0.1))
    refused(r"optim.lr would do nothing", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            cfg=config(tmp_path / "x"))
    refused("not both", model=model, optimizer=lambda g: torch.optim.SGD(g, lr=0.1),
            param_groups=[{"params": list(model.parameters())}])
    refused("returned list", optimizer=lambda g: [])
    refused("expected a list of dicts", param_groups=[list(model.parameters())], model=model)
    refused("optim.param_groups both", model=model, param_groups=[{"params": list(model.parameters())}],
            cfg=config(tmp_path / "x", optim={"param_groups": [{"match": "emb.*", "lr_scale": 2.0}]}))
    dims = SimpleNamespace(zero1=True)
    with pytest.raises(ConfigError, match="parallel.zero=1"):
        check_user_optimizer(UserOptimizer(optimizer=lambda g: torch.optim.SGD(g, lr=0.1)), dims, True)
    with pytest.raises(ConfigError, match="model you pass as model="):
        check_user_optimizer(UserOptimizer(param_groups=[]), SimpleNamespace(zero1=False), False)
    with pytest.raises(ConfigError, match="give a factory"):
        check_user_optimizer(UserOptimizer(optimizer=torch.optim.SGD(model.parameters(), lr=0.1)),
                              SimpleNamespace(zero1=False), False)
