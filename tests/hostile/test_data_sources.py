"""Hostile data sources: a device, FIFO or socket, a link loop, a file that vanishes or cannot be read,
and a huge document make `prepare` fail at once with a DataError, or are skipped and counted; nothing
hangs, and memory stays bounded."""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.config import load_config
from lmforge.config.schema import DataConfig
from lmforge.data import Tokenizer, open_shard, prepare
from lmforge.data.curate.readers import check_inputs, plan_pieces
from lmforge.data.sources import SourceStats, iter_documents
from lmforge.errors import DataError

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "debug" / "tiny.yaml"
prepare_mod = importlib.import_module("lmforge.data.prepare")  # the package attribute is the function
WORDS = "the model reads tokens while a tokenizer splits text into pieces and shards hold them".split()
HAS_DEV_ZERO = os.path.exists("/dev/zero") and stat.S_ISCHR(os.stat("/dev/zero").st_mode)
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
needs_alarm = pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="needs SIGALRM")


def words(n_chars: int, seed: int = 0, sep: str = " ") -> str:
    rng = random.Random(seed)
    out = sep.join(rng.choice(WORDS) for _ in range(n_chars // 4 + 8))
    return out[:n_chars]


def overrides(tmp_path: Path, sources: list[Path], *extra: str) -> list[str]:
    return [f"run.dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'data'}",
            f"data.sources=[{', '.join(str(s) for s in sources)}]", "data.max_chars=null",
            "logging.progress=none", "data.tokenizer.vocab_size=300", "data.tokenizer.train_chars=100000",
            *extra]


def cli_prepare(tmp_path: Path, sources: list[Path]) -> subprocess.CompletedProcess:
    """`lmforge prepare` in a subprocess: a hang fails the test after 60 s instead of blocking it."""
    sets = [a for o in overrides(tmp_path, sources) for a in ("--set", o)]
    return subprocess.run([sys.executable, "-m", "lmforge", "prepare", "-c", str(TINY), *sets],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})


@contextlib.contextmanager
def deadline(seconds: int = 60):
    """Raise instead of hanging: SIGALRM interrupts a blocked open() or read() in this process."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s: it hangs")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("lmforge prepare: error:")
    for needle in needles:
        assert needle in proc.stderr


# ---- sources named explicitly -------------------------------------------------------------------


@needs_fifo
def test_fifo_named_as_a_source_is_an_error_not_a_hang(tmp_path):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    assert_one_line_error(cli_prepare(tmp_path, [fifo]), str(fifo), "is a FIFO (named pipe)",
                          "not a regular file or a folder")


@pytest.mark.skipif(not HAS_DEV_ZERO, reason="no /dev/zero here")
def test_dev_zero_named_as_a_source_is_an_error_not_a_read_until_oom(tmp_path):
    link = tmp_path / "corpus.txt"
    link.symlink_to("/dev/zero")
    for src in (Path("/dev/zero"), link):  # a link is judged by what it points to
        assert_one_line_error(cli_prepare(tmp_path, [src]), str(src), "is a character device")


@needs_fifo
@needs_alarm
def test_bad_explicit_sources_fail_before_anything_is_read(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "a.txt").write_text("fine")
    cases = {"fifo": "is a FIFO", "loop": "cannot be opened", "missing.txt": "does not exist"}
    with deadline():
        for name, problem in cases.items():
            with pytest.raises(DataError, match=rf"data source '.*{name}' {problem}.*give a file, a folder"):
                next(iter_documents(DataConfig(sources=[str(tmp_path / "a.txt"), str(tmp_path / name)]),
                                    SourceStats()))


# ---- inside a folder -----------------------------------------------------------------------------


@needs_fifo
@needs_alarm
def test_specials_and_link_loops_in_a_folder_are_skipped_and_counted(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for i, name in enumerate(("a.txt", "b.txt", "sub/c.txt")):
        (root / name).write_text(words(300, seed=i))
    os.mkfifo(root / "pipe.txt")  # a readable extension: only its type keeps it from being opened
    (root / "to_pipe.txt").symlink_to(root / "pipe.txt")
    (root / "dangling.txt").symlink_to(root / "nowhere.txt")
    (root / "self.txt").symlink_to("self.txt")  # ELOOP
    (root / "again").symlink_to(".")  # a folder loop: corpus/again/again/... would never end
    (root / "sub" / "up").symlink_to("..")
    specials = 6
    if HAS_DEV_ZERO:
        (root / "zero.txt").symlink_to("/dev/zero")
        specials += 1
    sock = socket.socket(socket.AF_UNIX) if hasattr(socket, "AF_UNIX") else None
    if sock is not None and len(str(root / "s.txt")) < 100:  # AF_UNIX paths are short
        sock.bind(str(root / "s.txt"))
        specials += 1
    try:
        cfg = load_config(TINY, overrides(tmp_path, [root]))
        with deadline():
            p = prepare(cfg, console=lambda *_: None)
    finally:
        if sock is not None:
            sock.close()
    st = SourceStats(**p.meta["stats"])
    assert (st.documents, st.files, st.skipped_not_regular) == (3, 3, specials)  # each file read once
    assert f"skipped {specials} non-regular" in st.summary()
    kinds = " ".join(st.not_regular_examples)
    assert "again: a link back to a folder above it" in kinds and "dangling.txt: a dangling link" in kinds
    assert "pipe.txt: a FIFO (named pipe)" in kinds and "self.txt: a link loop" in kinds


@needs_fifo
def test_fifo_in_a_folder_does_not_hang_the_cli(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text(words(200, 1))
    (root / "b.txt").write_text(words(200, 2))
    os.mkfifo(root / "c.jsonl")
    proc = cli_prepare(tmp_path, [root])
    assert proc.returncode == 0, proc.stderr
    assert "skipped 1 non-regular (e.g. " in proc.stdout


@needs_fifo
def test_curate_refuses_a_fifo_input_and_ignores_one_in_a_folder(tmp_path):
    os.mkfifo(tmp_path / "pipe.jsonl")
    with pytest.raises(DataError, match=r"curate input '.*pipe\.jsonl' is a FIFO"):
        check_inputs([str(tmp_path / "pipe.jsonl")])
    (tmp_path / "a.txt").write_text("text")
    pieces, ignored = plan_pieces([str(tmp_path)])  # would block counting the FIFO's lines
    assert [p.paths for p in pieces] == [[str(tmp_path / "a.txt")]] and ignored == 1


# ---- files that vanish or cannot be read ---------------------------------------------------------


def test_file_that_vanishes_while_reading_is_a_data_error(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "c.jsonl").write_text('{"text": "third"}\n')
    it = iter_documents(DataConfig(sources=[str(tmp_path)]), SourceStats())
    assert next(it) == "first"  # the folder was listed; now its other files go
    (tmp_path / "b.txt").unlink()
    with pytest.raises(DataError, match=r"cannot read .*b\.txt: it disappeared while being read"):
        next(it)
    it = iter_documents(DataConfig(sources=[str(tmp_path)]), SourceStats())
    assert next(it) == "first"
    (tmp_path / "c.jsonl").unlink()
    with pytest.raises(DataError, match=r"cannot read .*c\.jsonl: it disappeared"):
        next(it)
    with pytest.raises(DataError, match=r"cannot read .*gone\.txt \(No such file"):
        prepare_mod._stat(tmp_path / "gone.txt")  # the fingerprint's view of the same race


def test_permission_denied_is_a_data_error(tmp_path, monkeypatch):
    """Simulated, so that it also runs as root (where chmod 000 does not stop reads)."""
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "secret.txt").write_text("second")
    real_open = os.open

    def deny(path, *args, **kw):
        if str(path).endswith("secret.txt"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "open", deny)
    with pytest.raises(DataError, match=r"cannot read .*secret\.txt: Permission denied; make it a readable"):
        list(iter_documents(DataConfig(sources=[str(tmp_path)]), SourceStats()))
    monkeypatch.undo()

    (tmp_path / "secret.txt").unlink()
    (tmp_path / "locked").mkdir()
    real_scandir = os.scandir

    def deny_listing(path):
        if str(path).endswith("locked"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", deny_listing)
    with pytest.raises(DataError, match=r"cannot list folder .*locked \(Permission denied\); make it"):
        list(iter_documents(DataConfig(sources=[str(tmp_path)]), SourceStats()))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root reads files whatever their mode")
def test_unreadable_file_and_folder_are_data_errors(tmp_path):
    root = tmp_path / "corpus"
    (root / "locked").mkdir(parents=True)
    (root / "a.txt").write_text(words(200, 1))
    (root / "b.txt").write_text(words(200, 2))
    (root / "locked" / "c.txt").write_text(words(200, 3))
    (root / "b.txt").chmod(0)
    try:
        with pytest.raises(DataError, match=r"cannot read .*b\.txt: Permission denied"):
            prepare(load_config(TINY, overrides(tmp_path, [root])), console=lambda *_: None)
        (root / "b.txt").chmod(0o644)
        (root / "locked").chmod(0)
        with pytest.raises(DataError, match=r"cannot list folder .*locked \(Permission denied\)"):
            prepare(load_config(TINY, overrides(tmp_path, [root])), console=lambda *_: None)
        assert_one_line_error(cli_prepare(tmp_path, [root]), "locked", "Permission denied")
    finally:
        (root / "b.txt").chmod(0o644)
        (root / "locked").chmod(0o755)


# ---- huge documents ------------------------------------------------------------------------------

_CHILD = """
import json, resource, sys
from lmforge.config import load_config
from lmforge.data import prepare
p = prepare(load_config(sys.argv[1], sys.argv[2:]), console=lambda *_: None)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
print(json.dumps({"peak": peak, "splits": p.meta["splits"]}))
"""
HUGE_CHARS = 20_000_000
# Before pieces, preparing this one 20 MB line took 3.6 GB (.txt) and 2.4 GB (.jsonl), 120-180 bytes per
# char; with them 0.24 GB (.txt) and 0.27 GB (.jsonl) on 2 cores, 0.30 GB with 64 tokenizer threads:
# the document, its ids and a fixed amount for the pieces in flight (at most ~0.45 GB per encode call).
# 1.5 GB leaves room for allocators on machines with many more cores, and still fails the old code.
PEAK_LIMIT = 1_500_000_000


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_a_huge_document_without_newlines_prepares_in_bounded_memory(tmp_path, kind):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("a small first document: it goes to val\n")
    huge = words(HUGE_CHARS)
    assert "\n" not in huge
    if kind == "txt":
        (root / "b.txt").write_text(huge)
    else:
        (root / "b.jsonl").write_text(json.dumps({"text": huge}))
    del huge
    # train_chars covers the whole document, so the tokenizer trainer reads it too
    args = overrides(tmp_path, [root], f"data.tokenizer.train_chars={HUGE_CHARS + 1000}")
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(TINY), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["splits"]["train"]["documents"] == 1 and out["splits"]["train"]["tokens"] > HUGE_CHARS // 10
    assert out["peak"] < PEAK_LIMIT, f"peak RSS {out['peak'] / 1e9:.2f} GB for {HUGE_CHARS / 1e6:.0f} MB"


def test_pieces_encode_to_the_ids_of_the_whole_document(monkeypatch):
    rng = random.Random(5)
    seps = [" ", " ", " ", "  ", "\n", "\n\n", "\t", " \t ", "\r\n", "\u00a0", "\u3000", "\x1c", " \u2028 "]
    vocab = WORDS + ["don't", "x2", "42!", "(é)"]
    text = "".join(rng.choice(vocab) + rng.choice(seps) for _ in range(60_000))
    tok = Tokenizer.train([text[:100_000]], 400)
    monkeypatch.setattr(prepare_mod, "_PIECE_CHARS", 5000)
    monkeypatch.setattr(prepare_mod, "_CUT_WINDOW", 500)
    monkeypatch.setattr(prepare_mod, "_CALL_CHARS", 20_000)
    pieces = list(prepare_mod._pieces(text))
    assert "".join(pieces) == text and len(pieces) > 40 and all(0 < len(p) <= 5000 for p in pieces)
    # cuts fall before whitespace that follows a non-space: a byte-level BPE cannot tell the difference
    assert prepare_mod._encode_long(tok, text).tolist() == tok.encode(text) + [tok.eos_id]

    solid = "".join(rng.choice("abcdef") for _ in range(23_000))  # no whitespace at all: hard cuts
    assert [len(p) for p in prepare_mod._pieces(solid)] == [5000] * 4 + [3000]
    assert tok.decode(prepare_mod._encode_long(tok, solid).tolist()[:-1]) == solid


def test_long_documents_in_pieces_prepare_the_very_same_data(tmp_path, monkeypatch):
    """Documents over the threshold, cut into pieces for the trainer and the encoder, give the
    tokenizer and shards of encoding them whole (so only memory changes, not the data)."""
    root = tmp_path / "corpus"
    root.mkdir()
    for i, n in enumerate((500, 60_000, 800, 45_000, 30_000)):
        (root / f"{i}.txt").write_text(words(n, seed=i, sep=" \n"[i % 2]))

    def run(name: str):
        cfg = load_config(TINY, overrides(tmp_path, [root], f"data.dir={tmp_path / name}",
                                          "data.val_fraction=0.3"))
        return prepare(cfg, console=lambda *_: None)

    whole = run("whole")
    monkeypatch.setattr(prepare_mod, "_LONG_DOC_CHARS", 10_000)
    monkeypatch.setattr(prepare_mod, "_PIECE_CHARS", 3_000)
    monkeypatch.setattr(prepare_mod, "_CUT_WINDOW", 300)
    monkeypatch.setattr(prepare_mod, "_CALL_CHARS", 9_000)
    pieces = run("pieces")
    assert (whole.dir / "tokenizer.json").read_bytes() == (pieces.dir / "tokenizer.json").read_bytes()
    for split in ("train", "val"):
        a, b = whole.shards(split), pieces.shards(split)
        assert len(a) == len(b) and all((open_shard(x) == open_shard(y)).all() for x, y in zip(a, b))
        assert whole.meta["splits"][split] == pieces.meta["splits"][split]
