"""Hostile-suite cases for answers that used to be silently wrong (issue 32, section 5): `scaling fit` of
a sweep dir, `eval` options a mode ignored (--limit above all), `prune` of a quantized run, `dpo` from an
adapter run, a `harmful` curation step that removed nothing. Lower-level checks (what --limit keeps, the
red team's non-answers, serve's logprobs, resuming from a saved config.yaml) are in test_answers_*.py."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path

from caselib import CHAT, CORPUS, Case, S, common, write

SWEEP = "sweeps/s1"
PAIRS = "".join(json.dumps({"prompt": f"What is {a} + {a}?", "chosen": str(2 * a), "rejected": str(a)}) + "\n"
                for a in range(4))


def _quiet(argv: list[str]) -> int:
    from lmforge.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(argv)


def _sweep(unfinished: bool = False) -> Callable[[Path], None]:
    """What `lmforge sweep --out sweeps/s1` leaves: a run dir per point (its resolved config.yaml and
    metrics.jsonl, losses on a known law), a log per point and sweep.json; `unfinished`: one more point
    cut short before its final validation."""

    def setup(ws: Path) -> None:
        import yaml

        from lmforge.config import load_config
        from lmforge.models.flops import count_params
        from lmforge.tools.scaling import LAWS

        points = [(32, 40_000), (32, 90_000), (64, 40_000), (64, 90_000), (96, 60_000)]
        for i, (d, tokens) in enumerate(points + ([(96, 90_000)] if unfinished else [])):
            run = ws / SWEEP / f"model.d_model={d},i={i}"
            run.mkdir(parents=True)
            cfg = load_config(None, ["model.vocab_size=512", f"model.d_model={d}", "model.n_layers=2"])
            (run / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
            records = [{"step": 20, "tokens_seen": tokens}]
            if i < len(points):
                records.append({"step": 20, "val_loss": LAWS["epoch"].loss(count_params(cfg.model), tokens)})
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            (run.parent / f"{run.name}.log").write_text("training log\n")
        (ws / SWEEP / "sweep.json").write_text('{"runs": []}\n')

    return setup


def _entries(ws: Path) -> list[str]:
    """`sweeps/s1/*` as the shell expands it: every entry of the sweep dir, logs and sweep.json too."""
    return sorted(str(p) for p in (ws / SWEEP).iterdir())


def _quantized(ws: Path) -> None:
    assert _quiet(["quantize", str(ws / "run"), str(ws / "q8"), "--bits", "8"]) == 0


def _lora_sft(ws: Path) -> None:
    """A LoRA SFT run of the workspace's model in ws/lora, and preference pairs to train on after it."""
    write("chat.jsonl", CHAT)(ws)
    write("pairs.jsonl", PAIRS)(ws)
    pairs = S(f"model.init_from={ws / 'run'}", f"sft.data=[{ws / 'chat.jsonl'}]", "train.max_steps=1",
              "data.dir=null", "finetune.method=lora", "train.micro_batch_size=1")
    assert _quiet(["sft", *common(ws, "lora"), *pairs]) == 0


def _curate(step: dict) -> Callable[[Path], None]:
    def setup(ws: Path) -> None:
        cur = {"inputs": [str(CORPUS)], "output_dir": str(ws / "curated"), "workers": 1, "steps": [step]}
        (ws / "curate.yaml").write_text(json.dumps({"curate": cur}))

    return setup


def _data(ws: Path) -> list[str]:
    return ["data", "-c", str(ws / "curate.yaml")]


TASKS = ('{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}], '
         '"task": "add", "answer": "2"}\n') * 3

FIT = lambda *args: lambda ws: ["scaling", "fit", *(a(ws) if callable(a) else a for a in args)]  # noqa: E731
EVAL = lambda *args: lambda ws: ["eval", str(ws / "run"), *(a(ws) if callable(a) else a for a in args)]  # noqa: E731
PRUNE = lambda src, *args: lambda ws: ["prune", str(ws / src), str(ws / "p"), *args]  # noqa: E731
TASKS_FILE = lambda ws: str(ws / "t.jsonl")  # noqa: E731

CASES: list[Case] = [
    # -- scaling fit: the README's `lmforge scaling fit sweeps/s1/*` (the sweep dir itself, with a point that
    # did not finish, is fitted in tests/unit/test_scaling.py: each fit costs seconds) -------------------
    Case("answers: scaling fit of a sweep dir's every entry",
         lambda ws: ["scaling", "fit", *_entries(ws), "--bootstrap", "0"], _sweep(), expect=0),
    Case("answers: scaling fit of an unfinished point named", lambda ws: ["scaling", "fit", *_entries(ws)],
         _sweep(unfinished=True), match="model.d_model=96,i=5"),
    Case("answers: scaling fit of logs only",
         FIT(lambda ws: str(ws / SWEEP / "sweep.json"), lambda ws: str(ws / "notes.txt")), _sweep(),
         match="no trained run to fit"),
    Case("answers: scaling fit of a pattern matching nothing", FIT(lambda ws: str(ws / "nope*")),
         match="no path matches"),
    # -- eval: an option is honoured or refused ----------------------------------------------------------
    Case("answers: eval --limit of the validation loss", EVAL("--limit", "5"),
         match="--limit does not apply to the validation loss"),
    Case("answers: eval --tasks JSONL --limit 1", EVAL("--tasks", TASKS_FILE, "--limit", "1"),
         write("t.jsonl", TASKS), expect=0),
    Case("answers: eval --limit 2.5", EVAL("--tasks", TASKS_FILE, "--limit", "2.5"), write("t.jsonl", TASKS),
         match="give a whole number of documents"),
    Case("answers: eval --tasks JSONL with --num-fewshot", EVAL("--tasks", TASKS_FILE, "--num-fewshot", "3"),
         write("t.jsonl", TASKS), match="--num-fewshot does not apply"),
    Case("answers: eval --tasks and --data at once", EVAL("--tasks", TASKS_FILE, "--data", str(CORPUS)),
         write("t.jsonl", TASKS), match="different evaluations"),
    # -- prune: a quantized run ----------------------------------------------------------------------------
    Case("answers: prune of an int8 run", PRUNE("q8", "--method", "magnitude", "--sparsity", "0.5"),
         _quantized, match="quantized"),
    Case("answers: prune of an int8 run, whole heads", PRUNE("q8", "--method", "heads", "--heads", "2"),
         _quantized, match="prune the run it was quantized from"),
    Case("answers: prune to sparsity 0", PRUNE("run", "--method", "magnitude", "--sparsity", "0"),
         match="argument --sparsity: must be a positive number < 1"),
    # -- a fine-tuning run from an adapter run ----------------------------------------------------------
    Case("answers: dpo from a LoRA run", lambda ws: ["dpo", *common(ws, "dpo"), *S(
        f"model.init_from={ws / 'lora'}", f"preference.data=[{ws / 'pairs.jsonl'}]", "data.dir=null",
        "train.max_steps=1")], _lora_sft, match="lmforge merge"),
    # -- curation: a harmful step that would remove nothing ----------------------------------------------
    Case("answers: data with an empty harmful step", _data, _curate({"step": "harmful", "lists": []}),
         match="block list is empty"),
    Case("answers: data with a missing block-list file", _data,
         _curate({"step": "harmful", "blocklist_files": ["/nonexistent/words.txt"]}), match="cannot read"),
]
