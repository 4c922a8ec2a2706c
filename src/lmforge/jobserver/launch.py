"""The small parent of every job process: `python -m lmforge.jobserver.launch JOB_DIR`.

It runs the command in JOB_DIR/launch.json with stdout / stderr appended to the job's logs, waits, and
writes JOB_DIR/exit.json (the command's exit status) when it ends, then, for an export job that
succeeded, packs the exported dir into a zip. The server starts it as the leader of a new process
group and does not need to be alive when it ends: a restarted server reads exit.json, so a job that
finished while the server was down gets its true outcome, and one whose launcher vanished without
exit.json is known to have been interrupted.

SIGTERM / SIGINT reach the whole process group (the job's cancel); the launcher itself outlives them
to record the outcome. Under memory pressure the kernel's out-of-memory killer takes the job's command
before its launcher (the command's oom_score_adj is raised), so the launcher lives to record it; and a
command that ended leaves nothing behind: the job's processes still running (torchrun's workers, in
sessions of their own, when the agent was killed) are stopped before exit.json is written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from lmforge.jobserver.procs import JOB_ENV, kill_all
from lmforge.utils.io import atomic_write_json

LAUNCH = "launch.json"
# Raised for the job's command and inherited by its processes: the kernel's out-of-memory killer prefers
# them to the launcher and the server (0) when memory runs out. Raising needs no privilege.
JOB_OOM_SCORE_ADJ = 500
EXIT = "exit.json"
STDOUT, STDERR = "stdout.log", "stderr.log"


def zip_dir(src: Path, dst: Path) -> None:
    """`src`'s files (not following links) into `dst`, written beside and swapped in."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for p in sorted(src.rglob("*")):
            if p.is_file() and not p.is_symlink():
                z.write(p, Path(src.name) / p.relative_to(src))
    os.replace(tmp, dst)


def _oom_first() -> None:  # runs in the child between fork and exec: no Python state beyond os
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(JOB_OOM_SCORE_ADJ))
    except OSError:  # not Linux, or already higher: as it is
        pass


def main(job_dir: str) -> int:
    d = Path(job_dir)
    spec = json.loads((d / LAUNCH).read_text(encoding="utf-8"))
    got: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: got.append(s))  # the child got it too (same group); we stay
    # nohup: the job outlives the server and its terminal (an ignored signal stays ignored in the child).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with open(d / STDOUT, "ab") as out, open(d / STDERR, "ab") as err:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(spec["argv"], stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=d,
                                env=env, preexec_fn=_oom_first)
        while True:
            try:
                code = proc.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries wait() itself
                continue
        job = os.environ.get(JOB_ENV)
        strays = kill_all(job) if job else 0
        if strays:
            err.write(f"lmforge jobs: {strays} process(es) of the job outlived its command "
                      f"(exit {code}) and were stopped\n".encode())
    archive = spec.get("archive")
    if code == 0 and archive:
        try:
            zip_dir(d / archive["src"], d / archive["dst"])
        except OSError as e:
            with open(d / STDERR, "a", encoding="utf-8") as f:
                f.write(f"lmforge jobs: error: cannot pack {archive['src']}: {e}\n")
            code = 2
    atomic_write_json(d / EXIT, {"code": code, "signals": got, "strays": strays, "finished_at": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
