"""`lmforge jobs` is the job server's verb (it was `lmforge server`, one letter from `lmforge serve`, the
model server); the old name runs the same verb for one release and says so in exactly one stderr line."""

from __future__ import annotations

import pytest

from lmforge.cli import main
from lmforge.cli.verbs import BY_NAME, RENAMED

OLD_LINE = ("lmforge server: warning: `lmforge server` is deprecated and goes after this release; it is now "
            "`lmforge jobs` (the same arguments)")


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # --help exits as argparse does
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_jobs_is_the_job_server_verb_and_server_is_no_verb():
    assert "jobs" in BY_NAME and "server" not in BY_NAME and RENAMED == {"server": "jobs"}


def test_jobs_help(capsys):
    rc, out, err = _run(capsys, ["jobs", "--help"])
    assert rc == 0 and err == ""
    assert out.startswith("usage: lmforge jobs ") and "--workspace" in out and "token" in out
    rc, top, _ = _run(capsys, ["--help"])
    assert rc == 0 and "server is now jobs" in " ".join(top.split())


def test_the_old_name_runs_the_same_verb_with_one_line(capsys, tmp_path):
    rc, new_help, _ = _run(capsys, ["jobs", "--help"])
    rc, old_help, err = _run(capsys, ["server", "--help"])
    assert rc == 0 and old_help == new_help and err.splitlines() == [OLD_LINE]

    ws = str(tmp_path / "ws")
    rc, out, err = _run(capsys, ["server", "token", "create", "--workspace", ws, "--user", "alice"])
    assert rc == 0 and out.startswith("lmf_")
    assert err.splitlines() == [OLD_LINE, "(shown once: the server keeps only its hash)"]
    rc, out, err = _run(capsys, ["jobs", "token", "list", "--workspace", ws])
    assert rc == 0 and "alice" in out and err == ""  # the token made through the old name is there


@pytest.mark.parametrize("verb", ["jobs", "server"])
def test_refusals_keep_their_exit_status(capsys, tmp_path, verb):
    """A user error (exit 2, one line naming the verb) and a usage error (exit 2) through either name; the
    old name adds only its one warning line."""
    a_file = tmp_path / "f"
    a_file.write_text("x")
    rc, _, err = _run(capsys, [verb, "token", "list", "--workspace", str(a_file)])
    lines = err.splitlines()
    assert rc == 2 and lines[-1] == f"lmforge jobs: error: --workspace {a_file} is not a directory"
    assert lines[:-1] == ([OLD_LINE] if verb == "server" else [])
    rc, _, err = _run(capsys, [verb, "--port", "0"])
    assert rc == 2 and "lmforge jobs: error: argument --port" in err
    assert err.count("deprecated") == (verb == "server")
