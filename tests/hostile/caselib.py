"""What the hostile-input suite's cases are made of: the Case record, the workspace every case starts
from (a trained run, its Hugging Face export and an imported model, the user's own notes), and the helpers
that damage it or spell a command. tests/hostile/suite.py holds the cases and runs them; more cases live in
tests/hostile/cases_*.py (one module per area, each with a CASES list), which the suite gathers.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

TINY = REPO / "configs" / "debug" / "tiny.yaml"
CORPUS = REPO / "tests" / "data" / "pydoc_topics.jsonl"
TIMEOUT_S = 90


@dataclass
class Case:
    name: str
    argv: Callable[[Path], list[str]]  # workspace -> CLI arguments
    setup: Callable[[Path], None] = lambda ws: None  # damage the workspace first (before hashing)
    expect: int = 2  # exit status: 2 (a clear error) or 0 (the input is legitimate)
    match: str = ""  # text the error message must contain
    subprocess: bool = False  # run in a child process (inputs that could exhaust memory or block)
    needs_non_root: bool = False


@dataclass
class Outcome:
    case: str
    rc: int | None
    output: str
    traceback: bool = False
    hang: bool = False
    changed: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def problems(self, case: Case) -> list[str]:
        out = []
        if self.hang:
            out.append("hang")
        if self.traceback:
            out.append("traceback")
        if self.changed:
            out.append(f"changed {self.changed[:3]}")
        if not self.hang and self.rc != case.expect:
            out.append(f"exit {self.rc}, expected {case.expect}")
        if case.expect == 2 and not self.hang:
            lines = self.output.strip().splitlines()
            if not any(line.startswith("lmforge ") and ": error: " in line for line in lines) and not any(
                "error:" in line for line in lines[:3]
            ):  # argparse's usage errors
                out.append(f"no clear error line (last line: {(lines or [''])[-1][:120]!r})")
            if case.match and case.match not in self.output:
                out.append(f"message lacks {case.match!r}")
        return out


# -- the workspace: a user's data, a trained run, its Hugging Face export and an imported model -----
def common(ws: Path, run: str = "run") -> list[str]:
    """A tiny run in the workspace, reading the workspace run's prepared data (run/data)."""
    return [
        "-c",
        str(TINY),
        "--set",
        f"run.dir={ws / run}",
        "--set",
        f"data.dir={ws / 'run' / 'data'}",
        "--set",
        f"data.sources=[{CORPUS}]",
        "--set",
        "data.max_chars=null",
        "--set",
        "logging.progress=none",
        "--set",
        "logging.plot=false",
    ]


def build_workspace(root: Path) -> Path:
    from lmforge.cli import main

    ws = root / "pristine"
    ws.mkdir(parents=True)
    shutil.copy2(CORPUS, ws / "corpus.jsonl")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        # data.dir unset: the data lives in run/data and the run's config.yaml names no absolute path, so a
        # copied workspace is self-contained.
        assert (
            main(
                [
                    "train",
                    *common(ws),
                    "--set",
                    "data.dir=null",
                    "--set",
                    "train.max_steps=2",
                    "--set",
                    "checkpoint.every=1",
                    "--set",
                    "train.eval_every=0",
                ]
            )
            == 0
        )
        assert main(["export", str(ws / "run"), str(ws / "hf")]) == 0
        assert main(["import", str(ws / "hf"), str(ws / "imported")]) == 0
    (ws / "notes.txt").write_text("the user's own file\n")
    return ws


# -- damage helpers ---------------------------------------------------------------------------------
def write(rel: str, data: bytes | str) -> Callable[[Path], None]:
    def setup(ws: Path) -> None:
        p = ws / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())

    return setup


def truncate(rel: str, size: int) -> Callable[[Path], None]:
    return lambda ws: os.truncate(ws / rel, size)


def remove(rel: str) -> Callable[[Path], None]:
    def setup(ws: Path) -> None:
        p = ws / rel
        shutil.rmtree(p) if p.is_dir() else p.unlink()

    return setup


def both(*fns: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(ws: Path) -> None:
        for f in fns:
            f(ws)

    return setup


class _Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(rel: str) -> Callable[[Path], None]:
    def setup(ws: Path) -> None:
        (ws / rel).write_bytes(pickle.dumps(_Planted(str(ws / "PWNED"))))

    return setup


def fifo(rel: str) -> Callable[[Path], None]:
    def setup(ws: Path) -> None:
        p = ws / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(p)

    return setup


CKPT = "run/checkpoints/step_00000002"
T = lambda *extra: lambda ws: ["train", *common(ws), *extra]  # noqa: E731
S = lambda *pairs: [x for p in pairs for x in ("--set", p)]  # noqa: E731


CHAT = (
    '{"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}\n'
    '{"prompt": "Say hi", "completion": "hi"}\n'
)


def SFT(*pairs: str) -> Callable[[Path], list[str]]:  # noqa: N802 - reads like T and S
    """`lmforge sft` from the workspace run on the workspace's chat.jsonl; {ws} in a pair is the workspace."""
    return lambda ws: [
        "sft",
        *common(ws, "sft"),
        "--set",
        f"model.init_from={json.dumps(str(ws / 'run'))}",
        "--set",
        f"sft.data={json.dumps([str(ws / 'chat.jsonl')])}",
        "--set",
        "train.max_steps=1",
        "--set",
        "data.dir=null",
        *S(*(p.format(ws=json.dumps(str(ws))[1:-1]) for p in pairs)),
    ]


