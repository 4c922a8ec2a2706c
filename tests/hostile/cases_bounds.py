"""Hostile cases of issue 32's "bounds" part: no unbounded work from a number or a file (task-file counts,
regexes, YAML alias bombs, sweep grids), every number validated at the edge (NaN, inf, out of range: CLI
flags, config keys, task files), and no verb replacing a file the user named without --overwrite."""

from __future__ import annotations

import json
from pathlib import Path

from caselib import Case, both, write

DOCS = '{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n'
TASK = (
    "task: t\ndataset_path: docs.jsonl\noutput_type: generate_until\n"
    'doc_to_text: "{{question}}"\ndoc_to_target: answer\ngeneration_kwargs: {max_gen_toks: 2}\n'
)
# 40 levels of doubling in one flow list: a few hundred bytes that stand for 2^40 values (whoever walks or
# prints the value, a validator's error message included, never finishes)
BOMB = "[&b0 [x, x], " + ", ".join(f"&b{i} [*b{i - 1}, *b{i - 1}]" for i in range(1, 41)) + "]"


def task(extra: str = "", docs: str = DOCS):
    """The workspace's task file t.yaml (with `extra` YAML appended) beside its documents docs.jsonl."""

    def setup(ws: Path) -> None:
        write("docs.jsonl", docs)(ws)
        write("t.yaml", TASK + extra)(ws)

    return setup


def eval_task(*extra: str, runs: tuple[str, ...] = ("run",)):
    return lambda ws: ["eval", *(str(ws / r) for r in runs), "--tasks", str(ws / "t.yaml"),
                       "--no-contamination", *extra]


def pass_at_k(option: str) -> str:
    return f"metric_list:\n  - {{metric: pass_at_k, k: 1, test: 'assert True', {option}}}\n"


def grid(axes: int, values: int) -> list[str]:
    out = []
    for a in ("train.max_steps", "train.micro_batch_size", "train.grad_accum_steps", "model.n_layers")[:axes]:
        out += ["--grid", f"{a}=" + ",".join(str(v) for v in range(1, values + 1))]
    return out


def case(name: str, *args, **kw) -> Case:
    """A Case whose name starts with "bounds: " (pytest -k bounds runs them all)."""
    return Case(f"bounds: {name}", *args, **kw)


CASES: list[Case] = [
    # -- a verb that would replace a file the user named -------------------------------------------
    case(
        "constitution --write-default over the user's file",
        lambda ws: ["constitution", "--write-default", str(ws / "notes.txt")],
        match="already exists",
    ),
    case(
        "constitution --write-default --overwrite to a new file",
        lambda ws: ["constitution", "--write-default", str(ws / "c.yaml"), "--overwrite"],
        expect=0,
    ),
    case(
        "scaling plan --out over the user's file",
        lambda ws: ["scaling", "plan", "--compute", "1e18", "--out", str(ws / "notes.txt")],
        match="already exists",
    ),
    case(
        "scaling fit --out over the user's file",
        lambda ws: ["scaling", "fit", str(ws / "run"), "--out", str(ws / "notes.txt")],
        match="already exists",
    ),
    case(
        "scaling fit --plot over the user's plot",
        lambda ws: ["scaling", "fit", str(ws / "run"), "--plot", str(ws / "figs")],
        write("figs/scaling_isoloss.png", b"the user's own figure"),
        match="already exists",
    ),
    case(
        "plot-schedule over the user's file",
        lambda ws: ["plot-schedule", "-o", str(ws / "notes.txt")],
        match="already exists",
    ),
    case(
        "lr-find plot over the user's file",
        lambda ws: ["lr-find", "--steps", "5", "-o", str(ws / "notes.txt")],
        match="already exists",
    ),
    case(
        "eval --compare-out over the user's file",
        eval_task("--compare-out", "{ws}/notes.txt", runs=("run", "imported")),
        task(),
        match="already exists",
    ),
    # -- unbounded work from a number or a file ----------------------------------------------------
    case("task file repeats 10**9", eval_task(), task("repeats: 1000000000\n"), match="'repeats' must be"),
    case(
        "task file pass_at_k.memory_mb 1e30",
        eval_task(),
        task(pass_at_k("memory_mb: 1.0e+30")),
        match="pass_at_k.memory_mb must be",
    ),
    case(
        "task file pass_at_k.timeout_s .inf",
        eval_task(),
        task(pass_at_k("timeout_s: .inf")),
        match="pass_at_k.timeout_s must be",
    ),
    case(
        "task file pass_at_k.timeout_s .nan",
        eval_task(),
        task(pass_at_k("timeout_s: .nan")),
        match="pass_at_k.timeout_s must be",
    ),
    case(
        "task file alias bomb",
        eval_task(),
        task(f"metadata: {BOMB}\n"),
        match="alias",
        subprocess=True,
    ),
    case(
        "task file nested too deep",
        eval_task(),
        task("metadata: " + "[" * 5000 + "]" * 5000 + "\n"),
        match="nest too deep",
    ),
    case(
        "task template regex_replace with catastrophic backtracking",
        eval_task(),
        task(
            "doc_to_text: \"{{ question | regex_replace('(x+x+)+y', '') }}\"\n",
            docs=json.dumps({"question": "x" * 3000, "answer": "2"}) + "\n",
        ),
        match="budget",
        subprocess=True,
    ),
    case(
        "task filter regex that does not compile",
        eval_task(),
        task("filter_list:\n  - {name: f, filter: [{function: regex, regex_pattern: '(unclosed'}]}\n"),
        match="does not compile",
    ),
    case("config file alias bomb", lambda ws: ["config", "-c", str(ws / "b.yaml")],
         write("b.yaml", f"run: {{name: {BOMB}}}\n"), match="alias", subprocess=True),
    case(
        "--set value alias bomb",
        lambda ws: ["config", "--set", f"run.name={BOMB}"],
        match="alias",
        subprocess=True,
    ),
    case(
        "config with ordinary anchors and aliases",
        lambda ws: ["config", "-c", str(ws / "a.yaml")],
        write("a.yaml", "train: {max_steps: 3, eval_every: &n 3}\ncheckpoint: {every: *n}\n"),
        expect=0,
    ),
    case(
        "constitution file alias bomb",
        lambda ws: ["constitution", str(ws / "run"), "--prompts", str(ws / "p.jsonl"), "-o", str(ws / "out"),
                    "--constitution", str(ws / "c.yaml")],
        both(write("p.jsonl", '{"prompt": "hi"}\n'),
             write("c.yaml", f"principles:\n  - {{name: {BOMB}, critique: c, revision: r}}\n")),
        match="alias",
        subprocess=True,
    ),
    case(
        "sweep of a 10^8-point grid",
        lambda ws: ["sweep", "--out", str(ws / "sw"), *grid(4, 100)],
        match="100,000,000 points",
        subprocess=True,
    ),
    case(
        "sweep --random 10^6 points",
        lambda ws: ["sweep", "--out", str(ws / "sw"), "--random", "1000000", "--grid", "optim.lr=1e-4..1e-2"],
        match="--random",
    ),
    case(
        "sweep range with nan",
        lambda ws: ["sweep", "--out", str(ws / "sw"), "--random", "2", "--grid", "optim.lr=nan..1e-2"],
        match="finite numbers",
    ),
    case("tasks --n 10^10", lambda ws: ["tasks", "-o", str(ws / "x.jsonl"), "--n", "10000000000"],
         match="--n"),
    # -- NaN, inf and out-of-range numbers ----------------------------------------------------------
    case("constitution --temperature nan",
         lambda ws: ["constitution", str(ws / "run"), "--temperature", "nan"], match="--temperature"),
    case("scaling plan --compute nan", lambda ws: ["scaling", "plan", "--compute", "nan"], match="--compute"),
    case("scaling plan --compute inf", lambda ws: ["scaling", "plan", "--compute", "inf"], match="--compute"),
    case("scaling plan --compute 1e400", lambda ws: ["scaling", "plan", "--compute", "1e400"],
         match="--compute"),
    case("scaling plan --params 1e300", lambda ws: ["scaling", "plan", "--params", "1e300"],
         match="no finite plan"),
    case("serve --port 70000", lambda ws: ["serve", str(ws / "run"), "--port", "70000", "--no-auth"],
         match="--port"),
    case("eval --limit nan", eval_task("--limit", "nan"), task(), match="--limit"),
    case("eval --batch-size 10^9", eval_task("--batch-size", "1000000000"), task(), match="--batch-size"),
    case("config lr .nan", lambda ws: ["config", "--set", "optim.lr=.nan"], match="finite"),
    case("config lr 1e999", lambda ws: ["config", "--set", "optim.lr=1e999"], match="finite"),
    case("config max_time .inf", lambda ws: ["config", "--set", "train.max_time=.inf"], match="max_time"),
    case("config run.seed 2^64", lambda ws: ["config", "--set", "run.seed=18446744073709551616"],
         match="run.seed"),
    case(
        "generate 10^8 samples in one batch",
        lambda ws: ["generate", str(ws / "run"), "--set", "generate.num_samples=100000000"],
        match="generate.num_samples",
    ),
    case(
        "generate temperature .nan",
        lambda ws: ["generate", str(ws / "run"), "--set", "generate.temperature=.nan"],
        match="finite",
    ),
    case(
        "curate step threshold .inf",
        lambda ws: ["config", "--set", "curate.steps=[{step: gopher_quality, max_words: 5, "
                    "max_mean_word_length: .inf}]"],
        match="finite",
    ),
]
