"""Fine-tuning runs keep lmforge's guarantees: `lmforge sft` end to end (checkpoints, train and
validation losses, eval, eval --tasks, generate --chat), a crashed run resumed gives the uninterrupted
loss curve and weights bit for bit (full and LoRA with adapter dropout), LoRA trains only its adapters
(the optimizer holds exactly them; the base stays bit-identical to model.init_from), EMA and the
spike guard run with SFT and the EMA weights evaluate, and bad input exits 2 with a message.

Every run starts from one tiny pretrained base (configs/debug/tiny.yaml, 8 steps) and fine-tunes on
one set of generated instruction tasks (module-scoped)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from conftest import TINY, Crash, CrashAt, tiny_overrides
from lmforge.assembly import build_run
from lmforge.checkpoint.runs import load_model, run_config
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data.instruct_tasks import split_disjoint, write_jsonl
from lmforge.finetune.setup import load_finetuned
from lmforge.metrics.loggers import read_metrics
from lmforge.train.trainer import Trainer, train

STEPS = 8
COMPARED = ("step", "loss", "grad_norm", "lr", "val_loss", "val_ppl", "val_bpb", "val_loss_ema",
            "tokens_seen")


@pytest.fixture(scope="module")
def world(tmp_path_factory, shared_data_dir) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("sft")
    base = tmp / "base"
    train(load_config(TINY, tiny_overrides(base, shared_data_dir, "train.max_steps=8", "checkpoint.every=0",
                                           "train.eval_every=0")))
    split = split_disjoint(None, 320, 40, seed=0)
    write_jsonl(split.train, tmp / "chat.jsonl")
    write_jsonl(split.test, tmp / "held_out.jsonl")
    return SimpleNamespace(tmp=tmp, base=base, chat=tmp / "chat.jsonl", held_out=tmp / "held_out.jsonl",
                           n_held_out=len(split.test))


def overrides(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.init_from={w.base}", f"sft.data=[{w.chat}]", "sft.val_fraction=0.1", f"run.dir={run_dir}",
        f"train.max_steps={STEPS}", "train.micro_batch_size=4", "train.grad_accum_steps=2",
        "train.precision=fp32", "train.threads=1", "train.log_every=1", "train.eval_every=4",
        "train.eval_batches=100", "checkpoint.every=4", "checkpoint.keep_last=3", "optim.lr=1e-3",
        "schedule.warmup_steps=2", "logging.progress=none", *extra,
    ]


def cli(w: SimpleNamespace, run_dir: Path, *extra: str) -> list[str]:
    return [a for o in overrides(w, run_dir, *extra) for a in ("--set", o)]


def sft_config(w: SimpleNamespace, run_dir: Path, *extra: str):
    return load_config(None, overrides(w, run_dir, "objective.name=sft", *extra))


def curve(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in COMPARED if k in r} for r in read_metrics(run_dir / "metrics.jsonl")]


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))


def weights_of(run_dir: Path, weights: str = "model") -> dict[str, torch.Tensor]:
    cfg, source = run_config(run_dir, [])
    model, _ = load_finetuned(cfg, source, weights)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sft_cli_end_to_end(world, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["sft", *cli(world, run)]) == 0
    assert checkpoints(run) == ["step_00000004", "step_00000008"]
    records = read_metrics(run / "metrics.jsonl")
    train_rows = [r for r in records if "loss" in r and "event" not in r]
    val_rows = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    assert [r["step"] for r in val_rows] == [4, 8]
    assert all(math.isfinite(r["loss"]) and r["tokens_seen"] > 0 for r in train_rows)
    # It learns the chat data: the validation loss falls (measured 5.917 at step 4 -> 5.768 at step 8).
    assert val_rows[1]["val_loss"] < val_rows[0]["val_loss"] - 0.05
    capsys.readouterr()

    # eval: the whole val split again, in other batches: the trainer's final validation loss.
    assert main(["eval", str(run)]) == 0
    assert "loss" in capsys.readouterr().out
    ev = json.loads((run / "eval_val_step_00000008.json").read_text())
    assert ev["step"] == STEPS
    assert ev["loss"] == pytest.approx(val_rows[1]["val_loss"], abs=1e-6)  # measured 1.9e-7 apart

    assert main(["eval", str(run), "--tasks", str(world.held_out)]) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "all" in out
    acc = json.loads((run / "eval_tasks_step_00000008.json").read_text())["accuracy"]
    assert sum(a["total"] for a in acc.values()) == world.n_held_out
    assert all(0 <= a["correct"] <= a["total"] for a in acc.values())

    prompt = "What is 2 + 3?"
    args = ["generate", str(run), "--chat", "--prompt", prompt, "--set", "generate.max_new_tokens=6",
            "--set", "generate.temperature=0"]
    assert main(args) == 0
    reply = capsys.readouterr().out
    # The assistant's reply only (this barely trained model's greedy reply is whitespace).
    assert reply.endswith("\n") and prompt not in reply and "<|im_" not in reply
    assert main(args) == 0
    assert capsys.readouterr().out == reply  # greedy: the same reply again



METHODS = {
    "full": (),
    # Adapter dropout draws from the RNG every step: its state must resume exactly too.
    "lora": ("finetune.method=lora", "finetune.r=4", "finetune.dropout=0.1"),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_crash_and_resume_is_bit_identical(world, tmp_path, method):
    extra = METHODS[method]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert main(["sft", *cli(world, straight, *extra)]) == 0

    with pytest.raises(Crash):
        Trainer(sft_config(world, crashed, *extra), callbacks=[CrashAt(6)]).fit()
    assert checkpoints(crashed) == ["step_00000004"]
    assert max(r["step"] for r in read_metrics(crashed / "metrics.jsonl")) == 6
    assert main(["sft", *cli(world, crashed, *extra), "--resume"]) == 0

    a, b = curve(straight), curve(crashed)
    assert [r["step"] for r in b] == [r["step"] for r in a]  # steps 5, 6 redone, not logged twice
    assert a == b  # exact float equality of every loss, grad norm, lr and validation metric
    wa, wb = weights_of(straight), weights_of(crashed)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_lora_trains_only_its_adapters(world, tmp_path):
    # r=4 on wq (64 -> 64) and v_proj, the Hugging Face name of wv (64 -> 2 kv heads x 16 = 32).
    extra = ("finetune.method=lora", "finetune.r=4", "finetune.targets=[wq, v_proj]")
    # 2 layers: A (r, in) + B (out, r) each; and the rows of ChatML's 2 new tokens in the (tied) table.
    expected = 2 * (4 * (64 + 64) + 4 * (64 + 32)) + 2 * 64
    run = build_run(sft_config(world, tmp_path / "built", *extra), "experiment", say=lambda *_: None)
    trainable = {n: p for n, p in run.model.named_parameters() if p.requires_grad}
    rows = "tok_embeddings.parametrizations.weight.0.rows"
    assert sorted(trainable) == sorted([rows, *(f"layers.{i}.attn.{m}.lora_{ab}" for i in (0, 1)
                                                for m in ("wq", "wv") for ab in "AB")])
    assert run.cfg.finetune.train_tokens == list(range(512, 514))
    assert sum(p.numel() for p in trainable.values()) == expected
    in_optimizer = [p for g in run.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in in_optimizer} == {id(p) for p in trainable.values()}
    assert len(in_optimizer) == len(trainable)

    out = tmp_path / "run"
    assert main(["sft", *cli(world, out, *extra)]) == 0
    # The checkpoint's optimizer state is the adapters' and nothing else.
    meta = FileSystemReader(str(out / "checkpoints" / "step_00000008" / "state")).read_metadata()
    # optim.state.<parameter FQN>.<exp_avg | exp_avg_sq | step>
    state = {k[len("optim.state."):].rsplit(".", 1)[0] for k in meta.state_dict_metadata
             if k.startswith("optim.state.")}
    assert state == set(trainable)

    tuned = weights_of(out)
    base_cfg, base_src = run_config(world.base, [])
    base = load_model(base_cfg, base_src)[0].state_dict()
    for name, w in base.items():
        lora_name = name.replace(".wq.weight", ".wq.base.weight").replace(".wv.weight", ".wv.base.weight")
        table = "tok_embeddings.parametrizations.weight.original"  # frozen under the trainable rows
        lora_name = lora_name.replace("tok_embeddings.weight", table)
        t = tuned[lora_name]
        if name in ("tok_embeddings.weight", "output.weight"):  # grown by the chat template's tokens
            assert t.shape[0] > w.shape[0]
            t = t[: w.shape[0]]
        assert torch.equal(t, w), f"{name} changed"
    for name in trainable:
        if name.endswith("lora_B"):
            assert tuned[name].abs().max() > 0  # B starts at zero: the adapters did train
    # The new tokens' rows trained away from where they started (the mean of the trained rows).
    start = base["tok_embeddings.weight"][:512].float().mean(0)
    assert (tuned[rows] - start).abs().max() > 1e-4


@pytest.mark.parametrize("method", ["lora", "full"])
def test_ema_and_spike_guard_with_sft(world, tmp_path, capsys, method):
    extra = ("averaging.ema=true", "averaging.ema_decay=0.9", "stability.spike_detection=true",
             *METHODS[method])
    run = tmp_path / "run"
    assert main(["sft", *cli(world, run, *extra)]) == 0
    val = [r for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in val] == [4, 8]
    assert all(math.isfinite(r["val_loss_ema"]) and r["val_loss_ema"] != r["val_loss"] for r in val)
    capsys.readouterr()
    rc = main(["eval", str(run), "--weights", "ema"])
    assert rc == 0, capsys.readouterr().err
    ev = json.loads((run / "eval_val_step_00000008_ema.json").read_text())
    assert ev["loss"] == pytest.approx(val[1]["val_loss_ema"], abs=1e-6)  # measured 9.5e-8 (full)


def _bad_role(w, tmp):
    good = w.chat.read_text().splitlines()[:2]
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hello"}]}
    path = tmp / "bad_role.jsonl"
    path.write_text("\n".join([*good, json.dumps(bad)]) + "\n")
    return [f"sft.data=[{path}]", "sft.on_bad_record=fail"], [f"{path}:3", "'wizard'", "valid roles"]


def _no_data(w, tmp):
    return ["sft.data=[]"], ["sft.data"]


def _missing_file(w, tmp):
    return [f"sft.data=[{tmp / 'nope.jsonl'}]"], ["nope.jsonl", "does not exist"]


def _bad_template(w, tmp):
    path = tmp / "bad.jinja"
    path.write_text("{{ raise_exception('nope') }}")
    return [f"sft.template={path}"], ["nope"]


def _wrong_objective(w, tmp):
    return ["objective.name=causal_lm"], ["objective.name=causal_lm", "lmforge train"]


BAD = {"unknown_role": _bad_role, "no_data": _no_data, "missing_file": _missing_file,
       "template_raises": _bad_template, "causal_lm_objective": _wrong_objective}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_a_message(world, tmp_path, capsys, case):
    extra, says = BAD[case](world, tmp_path)
    run = tmp_path / "run"
    assert main(["sft", *cli(world, run, *extra)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmforge sft: error: ") and "Traceback" not in err
    for text in says:
        assert text in err, (text, err)
    assert not (run / "checkpoints").exists() or not checkpoints(run)
