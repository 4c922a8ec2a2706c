"""Shared fixtures: the tiny debug recipe pointed at temporary dirs and a fixed shipped corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.config import Config, load_config
from lmforge.train.callbacks import Callback

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "debug" / "tiny.yaml"
CORPUS = REPO / "tests" / "data" / "pydoc_topics.jsonl"


def corpus_paragraphs(min_words: int = 12, max_words: int = 60) -> list[str]:
    """The shipped corpus's paragraphs of min_words..max_words words, whitespace collapsed (texts to train
    a small tokenizer on and to build evaluation documents from)."""
    out = []
    for line in CORPUS.read_text().splitlines():
        for para in json.loads(line)["text"].split("\n\n"):
            words = para.split()
            if min_words <= len(words) <= max_words:
                out.append(" ".join(words))
    return out


def tiny_overrides(run_dir: Path, data_dir: Path, *extra: str) -> list[str]:
    """Overrides that make configs/debug/tiny.yaml hermetic: shipped corpus, temp dirs, quiet."""
    return [
        f"run.dir={run_dir}",
        f"data.dir={data_dir}",
        f"data.sources=[{CORPUS}]",
        "data.max_chars=null",
        "logging.progress=none",
        *extra,
    ]


@pytest.fixture(scope="session", autouse=True)
def _probe_cache(tmp_path_factory):
    """Start-up probes (precision and threads `auto`) cache their verdicts in a session dir, never in the
    user's ~/.cache; subprocesses inherit it."""
    import os

    os.environ["LMFORGE_CACHE_DIR"] = str(tmp_path_factory.mktemp("lmforge-cache"))


@pytest.fixture(scope="session")
def shared_data_dir(tmp_path_factory) -> Path:
    """One prepared copy of the shipped corpus for every test that does not test preparation."""
    return tmp_path_factory.mktemp("prepared") / "data"


@pytest.fixture
def tiny_cfg(tmp_path, shared_data_dir):
    def make(*extra: str) -> Config:
        return load_config(TINY, tiny_overrides(tmp_path / "run", shared_data_dir, *extra))

    return make


class Crash(RuntimeError):
    """What `CrashAt` raises: a run dying mid-way, for the crash + resume tests."""


class CrashAt(Callback):
    """Dies after step `at` (pick a step that is not a checkpoint: the resumed run must redo steps)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, trainer, step, result):
        if step == self.at:
            raise Crash(f"crash after step {step}")


@pytest.fixture
def code_sandbox() -> str:
    """The operating-system sandbox of pass@k (eval/sandbox/), or a skip that says what is missing and how
    to install it (scripts/test.sh installs bubblewrap where it can)."""
    from lmforge.eval.sandbox import SandboxUnavailable, check_isolation

    try:
        return check_isolation()
    except SandboxUnavailable as e:
        pytest.skip(f"no code sandbox on this machine: {e}")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A 300-token byte-level BPE with the chat template's two specials: the tokenizer of the GGUF export
    tests' tiny models (tests/integration/test_export_gguf*.py; their helpers: gguf_models.py)."""
    from lmforge.data.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("tok")
    text = ("the quick brown fox jumps over the lazy dog; hello world, 12345 times. " * 40
            + "pack my box with five dozen liquor jugs! ")
    tok = Tokenizer.train([text], 300, 2)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(root / "tok.json")
    return root / "tok.json"
