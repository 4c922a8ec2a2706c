"""Hostile-input cases of the job server's verb and of the run-dir protection (wave 3, jobs): every
numeric option of `lmforge jobs` out of range or not finite (refused before anything starts), and runs
whose run.dir is one of their own inputs (a teacher, adapters to start from, the principles a
constitution run reads): refused, the input intact."""

from __future__ import annotations

import json

from caselib import CHAT, Case, S, both, common, write


def _jobs(*opts: str):
    return lambda ws: ["jobs", "--workspace", str(ws / "srv"), *opts]


_NUMBERS = [
    (("--max-running", "0"), "argument --max-running: must be"),
    (("--max-running", "-5"), "argument --max-running: must be"),
    (("--jobs-per-minute", "nan"), "argument --jobs-per-minute: must be"),
    (("--jobs-per-minute", "inf"), "argument --jobs-per-minute: must be"),
    (("--jobs-per-minute", "-1"), "argument --jobs-per-minute: must be"),
    (("--job-burst", "0"), "argument --job-burst: must be"),
    (("--port", "70000"), "argument --port: must be"),
    (("--port", "0"), "argument --port: must be"),
    (("--ray-gpus-per-process", "nan"), "argument --ray-gpus-per-process: must be"),
    (("--max-procs-per-job", "0"), "argument --max-procs-per-job: must be"),
    (("--max-procs-per-job", "64", "--max-procs", "4"), "--max-procs-per-job 64 exceeds --max-procs 4"),
    (("--max-threads-per-job", "-3"), "argument --max-threads-per-job: must be"),
    (("--max-procs-per-user", "0"), "argument --max-procs-per-user: must be"),
    (("--max-memory-gb", "0"), "argument --max-memory-gb: must be"),
    (("--max-memory-gb", "nan"), "argument --max-memory-gb: must be"),
    (("--max-memory-gb-total", "1e400"), "argument --max-memory-gb-total: must be"),
    (("--max-memory-gb", "8", "--max-memory-gb-total", "4"), "--max-memory-gb 8 exceeds"),
]

def _chat(ws) -> str:
    return f"sft.data={json.dumps([str(ws / 'chat.jsonl')])}"  # JSON: the case's dir name holds a comma


_PRINCIPLES = "- {name: p, critique: 'Point out a flaw.', revision: 'Rewrite it better.'}\n"

CASES: list[Case] = [
    *(Case(f"jobs {' '.join(opts)}", _jobs(*opts), match=match) for opts, match in _NUMBERS),
    Case(
        "distill whose teacher is its own run dir, overwritten",
        lambda ws: ["distill", *common(ws), *S(f"distill.teacher={ws / 'run'}", "run.overwrite=true",
                                               "train.max_steps=1")],
        match="an input of this run, is run.dir",
    ),
    Case(
        "gkd whose teacher is its own run dir, overwritten",
        lambda ws: ["gkd", *common(ws), *S(f"model.init_from={ws / 'imported'}", _chat(ws),
                                          f"gkd.teacher={ws / 'run'}", "run.overwrite=true", "data.dir=null",
                                          "train.max_steps=1")],
        write("chat.jsonl", CHAT),
        match="an input of this run, is run.dir",
    ),
    Case(
        "sft whose starting adapters are its own run dir, overwritten",
        lambda ws: ["sft", *common(ws), *S(f"model.init_from={ws / 'imported'}",
                                          _chat(ws), "finetune.method=lora",
                                          f"finetune.init_adapter={ws / 'run'}", "run.overwrite=true",
                                          "data.dir=null", "train.max_steps=1")],
        write("chat.jsonl", CHAT),
        match="finetune.init_adapter=",
    ),
    Case(
        "sft starting from a checkpoint of its own run dir, resumed",
        lambda ws: ["sft", *common(ws), *S(f"model.init_from={ws / 'run' / 'checkpoints' / 'step_00000002'}",
                                          _chat(ws), "train.max_steps=1"),
                    "--resume"],
        write("chat.jsonl", CHAT),
        match="lies inside",
    ),
    Case(
        "constitution whose principles file is inside --out, overwritten",
        lambda ws: ["constitution", str(ws / "run"), "--prompts", str(ws / "prompts.jsonl"), "--out",
                    str(ws / "out"), "--constitution", str(ws / "out" / "principles.yaml"), "--overwrite",
                    "--limit", "1", "--max-new-tokens", "2", "--no-feedback"],
        both(write("prompts.jsonl", '{"prompt": "Say hi"}\n'), write("out/principles.yaml", _PRINCIPLES)),
        match="an input of this command",
    ),
]
