"""One job server per workspace: a second `lmforge jobs` on the same workspace is refused naming the
first one's pid (two runners on one server.db would start every queued job twice), and the lock dies
with its holder, kill -9 included, so a restart after a crash is never refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from lmforge.errors import LmforgeError
from lmforge.jobserver.server import free_port, lock_workspace, server_process

pytest.importorskip("uvicorn")


def test_the_workspace_lock_names_its_holder(tmp_path):
    ws = tmp_path / "ws"
    lock = lock_workspace(ws)
    with pytest.raises(LmforgeError, match=rf"--workspace {ws} is already served by another job server "
                                           rf"\(pid {os.getpid()} on "):
        lock_workspace(ws)
    lock.release()
    lock_workspace(ws).release()  # free again once released


def test_a_second_server_on_the_same_workspace_is_refused(tmp_path):
    ws = tmp_path / "ws"
    with server_process(ws) as first:
        before = (ws / "server.lock").read_text()
        second = subprocess.run([sys.executable, "-m", "lmforge", "jobs", "--workspace", str(ws), "--port",
                                 str(free_port())], capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith("lmforge jobs: error: --workspace") and f"(pid {first.proc.pid} on" in last
        assert (ws / "server.lock").read_text() == before  # the refused one changed nothing
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
    with server_process(ws) as again:  # the lock died with its holder
        assert f"pid {again.proc.pid} on" in (ws / "server.lock").read_text()
