"""Run model-written Python and say how it ended: the executor behind pass@k for code tasks (HumanEval /
MBPP: program = prompt + completion + test code + `check(...)`). That code, and a task file's `test`
field, is untrusted: it runs under two layers.

1. The operating system (isolation.py, the boundary): bubblewrap starts each program in its own user,
   pid, network, mount and IPC namespaces as an unprivileged user (uid 65534, no capabilities, kernel uid
   65534 when lmforge runs as root), under a seccomp filter (seccomp.py: no new processes, no namespace
   or mount calls, no ptrace, no device nodes), seeing only /usr and the Python installation read-only, a
   fresh /proc, a minimal /dev and two small tmpfs (/work, its cwd and HOME, and /tmp), with no network
   and no way to outlive its deadline (the pid namespace dies with bwrap, which the harness SIGKILLs).
2. The interpreter (prelude.py): resource limits (address space `memory_mb`, CPU ceil(timeout) + 1 s,
   file size 10 MB, 64 open files, 32 threads, no core dumps), and an audit hook that stops the process
   with a "forbidden" status when the program reaches for processes, signals, the network, ctypes,
   links or files outside its dir. It makes refusals clear; it is not a boundary (CPython says so).

Where the OS layer cannot run (no bubblewrap, user namespaces disabled), `check_isolation()` and every
run raise `SandboxUnavailable` naming the missing piece and how to install it; lmforge does not fall back
to a weaker sandbox. `isolation="hook"` (the CLI's --unsafe-code-exec) runs with the second layer only,
for code the user trusts.

Each program runs in a fresh `python -I -S` (isolated mode, the standard library only), stdin from
/dev/null, stdout / stderr captured (the first and last `output_limit / 2` bytes kept). A program that
exits 0 before its asserts run (`sys.exit(0)`, `os._exit(0)`) counts as passed, as in the reference
HumanEval harness. Linux only.
"""

from __future__ import annotations

import functools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lmforge.eval.sandbox import isolation
from lmforge.eval.sandbox.isolation import SandboxUnavailable
from lmforge.eval.sandbox.prelude import EXIT_ERROR, EXIT_FAILED, EXIT_FORBIDDEN, EXIT_MEMORY, MARKER, command

__all__ = [
    "ISOLATIONS", "STATUSES", "Outcome", "SandboxUnavailable", "check_isolation", "pass_at_k_scores",
    "run_many", "run_program",
]  # fmt: skip

STATUSES = ("passed", "failed", "timeout", "memory", "forbidden", "error")
ISOLATIONS = ("os", "hook")  # both layers; the audit hook alone (--unsafe-code-exec)
FILE_SIZE_LIMIT = 10 * 2**20  # bytes one file may grow to (RLIMIT_FSIZE)
OPEN_FILES_LIMIT = 64  # RLIMIT_NOFILE
THREADS_LIMIT = 32  # RLIMIT_NPROC inside the sandbox's own user namespace (threads; processes are refused)
OUTPUT_LIMIT = 10_000  # bytes of stdout and of stderr kept: the first and the last half
MAX_TIMEOUT_S = 600.0
MAX_MEMORY_MB = 65_536
MAX_OUTPUT_LIMIT = 10 * 2**20


@dataclass(frozen=True)
class Outcome:
    """How one program ended: `status` is one of STATUSES, `detail` a short line (the exception and
    the program line it came from, what was forbidden, the limit hit), `seconds` the wall time of the
    subprocess; stdout / stderr are the captured output, cut in the middle past `output_limit` bytes."""

    status: str
    detail: str
    seconds: float
    stdout: str = ""
    stderr: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(
    source: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    output_limit: int = OUTPUT_LIMIT,
    isolation: str = "os",
) -> Outcome:
    """Run `source` in the sandbox (see the module docstring) and classify how it ended: passed (exit 0),
    failed (AssertionError), error (another exception, a syntax error, a non-zero exit, a signal), timeout
    (wall clock `timeout_s` or the CPU limit), memory (MemoryError under the `memory_mb` address-space
    limit), forbidden (the audit hook stopped it). `isolation`: "os" (both layers) or "hook" (the audit
    hook only: --unsafe-code-exec)."""
    _check_arguments(timeout_s, memory_mb, output_limit, isolation)
    if isolation == "os":
        check_isolation()
    return _run(source, timeout_s, memory_mb, output_limit, os_layer=isolation == "os", hook=True)


def run_many(
    sources: Sequence[str],
    *,
    workers: int = 2,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    output_limit: int = OUTPUT_LIMIT,
    isolation: str = "os",
) -> list[Outcome]:
    """`run_program` over `sources`, `workers` at a time (threads driving subprocesses); the outcomes
    come back in the order of `sources`."""
    if not (isinstance(workers, int) and 1 <= workers <= 64):
        raise ValueError(f"workers must be an integer in [1, 64], got {workers!r}")
    _check_arguments(timeout_s, memory_mb, output_limit, isolation)
    if not sources:
        return []
    if isolation == "os":
        check_isolation()
    run = lambda source: _run(
        source, timeout_s, memory_mb, output_limit, os_layer=isolation == "os", hook=True
    )
    with ThreadPoolExecutor(max_workers=min(workers, len(sources)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(run, sources))


@functools.lru_cache(maxsize=1)
def check_isolation() -> str:
    """Start one sandboxed program and return the layers in words; raise SandboxUnavailable (saying what is
    missing and how to install it) where the operating-system sandbox cannot run. The answer is kept for
    the process (a failure is not, so installing bubblewrap while a server runs is seen)."""
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"the code sandbox needs Linux (namespaces, seccomp), not {sys.platform}")
    out = _run("print('ok')", 10.0, 256, 4000, os_layer=True, hook=True)
    if out.status != "passed" or out.stdout != "ok\n":
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        why = (lines[-1] if lines else out.detail)[:300]
        raise SandboxUnavailable(
            f"the code sandbox (bubblewrap) could not start a program: {why}. It needs unprivileged user "
            "namespaces: check `sysctl kernel.unprivileged_userns_clone` (Debian: 1), "
            "`kernel.apparmor_restrict_unprivileged_userns` (Ubuntu 24.04: 0, or an AppArmor profile for "
            "bwrap) and `user.max_user_namespaces` (> 0); in a container, run it with user namespaces "
            "allowed (e.g. docker --security-opt seccomp=unconfined)"
        )
    return isolation.layers()


def pass_at_k_scores(
    outcomes_per_problem: Sequence[Sequence[Outcome]], ks: Sequence[int] = (1, 5, 10)
) -> dict[str, float]:
    """{"pass@k": mean over problems of the unbiased pass@k (Chen et al. 2021) from each problem's n
    samples and c passes}. A problem with fewer than k samples is left out of pass@k's mean, and a k
    that no problem reaches has no key. The Codex / HumanEval convention reports pass@k only when every
    problem has n >= k: give every problem at least max(ks) samples for numbers comparable to papers."""
    from lmforge.eval.metrics import pass_at_k  # numpy: not needed to run programs (a bare python can)

    for k in ks:
        if k < 1:
            raise ValueError(f"pass@k needs k >= 1, got {k} in ks={tuple(ks)}")
    scores: dict[str, float] = {}
    for k in ks:
        values = [
            pass_at_k(len(outcomes), sum(o.passed for o in outcomes), k)
            for outcomes in outcomes_per_problem
            if len(outcomes) >= k
        ]
        if values:
            scores[f"pass@{k}"] = sum(values) / len(values)
    return scores




# ------------------------------------------------------------------------------------------ internals


def _check_arguments(timeout_s: float, memory_mb: int, output_limit: int, isolation: str) -> None:
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= MAX_TIMEOUT_S):
        raise ValueError(f"timeout_s must be a number in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout_s!r}")
    if not (isinstance(memory_mb, int) and 64 <= memory_mb <= MAX_MEMORY_MB):
        raise ValueError(
            f"memory_mb must be an integer in [64, {MAX_MEMORY_MB}] (Python needs some), got {memory_mb!r}"
        )
    if not (isinstance(output_limit, int) and 0 <= output_limit <= MAX_OUTPUT_LIMIT):
        raise ValueError(f"output_limit must be an integer in [0, {MAX_OUTPUT_LIMIT}], got {output_limit!r}")
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")


def _run(
    source: str, timeout_s: float, memory_mb: int, output_limit: int, *, os_layer: bool, hook: bool
) -> Outcome:
    """One program under the chosen layers (tests take them one at a time to show each holds alone)."""
    cpu_s = math.ceil(timeout_s) + 1
    root = os.path.realpath(tempfile.mkdtemp(prefix="lmforge-sandbox-"))
    launch = None
    try:
        program = os.path.join(root, "program.py")  # beside the work dir, not in it: read-only to the program
        with open(program, "w", encoding="utf-8", errors="replace") as f:
            f.write(source)
        if os_layer:
            os.chmod(program, 0o644)  # read inside by the sandbox's unprivileged user
            limits = [memory_mb * 2**20, cpu_s, FILE_SIZE_LIMIT, OPEN_FILES_LIMIT, THREADS_LIMIT]
            argv = command(
                isolation.python_executable(), [isolation.WORK, "/tmp"], isolation.PROGRAM, limits,
                drop=isolation.NOBODY, hook=hook,
            )  # fmt: skip
            launch = isolation.launch(program, argv)
            argv, cwd, env, fds = launch.argv, root, {}, launch.fds
        else:
            work = os.path.join(root, "work")
            os.mkdir(work, 0o700)
            limits = [memory_mb * 2**20, cpu_s, FILE_SIZE_LIMIT, OPEN_FILES_LIMIT, 0]
            argv = command(sys.executable, [work], program, limits, drop=0, hook=hook)
            cwd, fds = work, []
            env = {"HOME": work, "TMPDIR": work, "MALLOC_ARENA_MAX": "2"}  # arenas eat RLIMIT_AS per thread
        rc, timed_out, stdout, stderr, seconds = _execute(argv, cwd, env, timeout_s, output_limit, fds)
    finally:
        if launch is not None:
            launch.close()
        _remove_tree(root)
    if os_layer and rc > 128 and rc - 128 in _SIGNALS:
        rc = 128 - rc  # bwrap reports a signal as 128 + its number, as a shell does
    status, detail = _classify(rc, timed_out, stderr, timeout_s, cpu_s)
    return Outcome(status, detail, seconds, stdout, stderr)


_SIGNALS = frozenset(int(s) for s in signal.Signals)


class _Capture:
    """The first and the last `limit / 2` bytes of a stream, and how many bytes it carried."""

    def __init__(self, limit: int) -> None:
        self.half = limit // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            del self.tail[: max(0, len(self.tail) - self.half)]

    def text(self) -> str:
        cut = self.total - len(self.head) - len(self.tail)
        middle = f"\n... [{cut} bytes cut] ...\n".encode() if cut else b""
        return (bytes(self.head) + middle + bytes(self.tail)).decode("utf-8", "replace")


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its pid and group id stay reserved)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _execute(
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    timeout_s: float,
    output_limit: int,
    fds: Sequence[int] = (),
) -> tuple[int, bool, str, str, float]:
    """Run argv in a new session, reading its output until it exits or the deadline passes; then
    SIGKILL its whole process group (before reaping the leader, so the group id cannot have been
    reused). Returns (returncode, timed_out, stdout, stderr, seconds)."""
    start = time.monotonic()
    deadline = start + timeout_s
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, close_fds=True, pass_fds=tuple(fds),
    )  # fmt: skip
    out, err = _Capture(output_limit), _Capture(output_limit)
    timed_out = True
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ, out)
            selector.register(proc.stderr, selectors.EVENT_READ, err)
            while selector.get_map() and time.monotonic() < deadline:
                ready = selector.select(min(deadline - time.monotonic(), 0.05))
                for key, _ in ready:
                    data = os.read(key.fd, 65536)
                    if data:
                        key.data.add(data)
                    else:
                        selector.unregister(key.fileobj)
                if not ready and _exited(proc.pid):
                    break  # the pipes are held open by something else: stop listening
        while time.monotonic() < deadline:
            if _exited(proc.pid):
                timed_out = False
                break
            time.sleep(0.002)
    finally:
        for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return proc.returncode, timed_out, out.text(), err.text(), time.monotonic() - start


def _classify(rc: int, timed_out: bool, stderr: str, timeout_s: float, cpu_s: int) -> tuple[str, str]:
    marked = [line[len(MARKER) :] for line in stderr.splitlines() if line.startswith(MARKER)]
    detail = marked[-1] if marked else ""
    if timed_out:
        return "timeout", f"still running after {timeout_s:g} s"
    if rc == 0:
        return "passed", ""
    if rc == EXIT_FAILED:
        return "failed", detail or "AssertionError"
    if rc == EXIT_MEMORY:
        return "memory", detail or "MemoryError"
    if rc == EXIT_FORBIDDEN:
        return "forbidden", detail or "forbidden"
    if rc == EXIT_ERROR:
        return "error", detail or "exception"
    if rc == -signal.SIGXCPU:
        return "timeout", f"CPU time limit ({cpu_s} s)"
    if rc == -signal.SIGXFSZ:
        return "error", f"file size limit ({FILE_SIZE_LIMIT // 2**20} MB)"
    if rc < 0:
        return "error", f"killed by {signal.Signals(-rc).name}"
    return "error", f"exit status {rc}"


def _remove_tree(root: str) -> None:
    """Delete the sandbox dir, first giving back permissions the program may have taken away."""
    for dirpath, dirnames, _ in os.walk(root):
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                try:
                    os.chmod(path, 0o700)
                except OSError:
                    pass
    shutil.rmtree(root, ignore_errors=True)
