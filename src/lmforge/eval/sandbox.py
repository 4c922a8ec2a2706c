"""Run model-written Python in a throw-away subprocess and say how it ended: the executor behind
pass@k for code tasks (HumanEval / MBPP: program = prompt + completion + test code + `check(...)`).

Each program runs in a fresh `python -I -S` (isolated mode, no site-packages: the standard library
only) with an environment holding nothing but HOME / TMPDIR (both the sandbox dir) and
MALLOC_ARENA_MAX, stdin from /dev/null, stdout / stderr captured (the first and last `output_limit / 2`
bytes kept), cwd a fresh temporary dir deleted afterwards, in its own session and process group: the
whole group is killed with SIGKILL when the program ends or runs out of time. A prelude sets resource
limits (address space `memory_mb`, CPU ceil(timeout) + 1 s, file size 10 MB, 64 open files, no core
dumps), installs an audit hook (`sys.addaudithook`: hooks cannot be removed once added) and then runs
the program as `__main__`. The hook stops the process with `os._exit(_EXIT_FORBIDDEN)` (after one
line on stderr saying why) when the program tries to

- create a process: subprocess, os.system, os.exec*, os.posix_spawn, os.fork / forkpty, importing
  _posixsubprocess (whose fork_exec is not audited), sub-interpreters;
- signal another process (os.kill / killpg), raise its resource limits, or use the network (every
  `socket.*` event: connect, bind, sendto, name lookups, creating any socket but an AF_UNIX one,
  which is how socketpair gives asyncio its self-pipe);
- write, create, delete, rename, chmod / chown / utime / truncate / xattr anything outside its
  temporary dir (the `open` event with a write flag, os.remove / rmdir / mkdir / rename / ...,
  shutil.rmtree), make a symbolic or hard link (which is what keeps the hook's lexical path check
  exact), or take a handle on a directory outside the sandbox (which os.open's unaudited dir_fd
  could then write through);
- import ctypes / _ctypes (or make any `ctypes.*` call), _testcapi / _testinternalcapi,
  _xxsubinterpreters, or load a C extension written inside the sandbox;
- rewrite a function's `__code__` / `__defaults__` (the hook keeps its state in default arguments
  and uses no globals or closures, so the program cannot rewire it).

Exiting the process, rather than raising, is the point: `except Exception` (or `except BaseException`)
in the program cannot swallow it, and a program that fakes the exit code only marks itself
"forbidden". Reading files is allowed (imports need it), and so is writing inside the temp dir.

What it cannot stop. Audit hooks are not a security boundary (CPython says so): a deliberate
attacker can escape, e.g. with hand-made bytecode (`types.CodeType`, `marshal.loads`) that corrupts
memory, through unaudited posix calls (os.pidfd_open + signal.pidfd_send_signal, os.chroot, os.mknod
as root), through a PathLike whose `__fspath__` answers an os.* function and the hook differently,
or by a race between the check and the system call in another thread. The program can read every file the
harness's user can read (as root, that is everything) and see the host's processes in /proc. It can
fill the disk with many files under 10 MB each for as long as it runs, and RLIMIT_NPROC does not bind
root. The sandbox is for accidents by model-written code (infinite loops, huge allocations, deleting
files, stray network calls), not for adversaries: for those, also run the evaluator as an
unprivileged user inside a container or VM with no network (or under nsjail / bubblewrap / gVisor).

A program that exits 0 before its asserts run (`sys.exit(0)`, `os._exit(0)`) counts as passed, as in
the reference HumanEval harness. Linux only (/proc/self/fd resolves dir_fd-relative paths).
"""

from __future__ import annotations

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

from lmforge.eval.metrics import pass_at_k

STATUSES = ("passed", "failed", "timeout", "memory", "forbidden", "error")
FILE_SIZE_LIMIT = 10 * 2**20  # bytes one file may grow to (RLIMIT_FSIZE)
OPEN_FILES_LIMIT = 64  # RLIMIT_NOFILE
OUTPUT_LIMIT = 10_000  # bytes of stdout and of stderr kept: the first and the last half

# exit codes the prelude (and the audit hook) ends the child with; any other code is an "error"
_EXIT_FAILED, _EXIT_ERROR, _EXIT_MEMORY, _EXIT_FORBIDDEN = 201, 202, 203, 204
_MARKER = "[lmforge-sandbox] "  # the line on stderr that carries the detail

# Runs in the child as `python -I -S -c PRELUDE work program memory cpu fsize nofile`. Everything the
# audit hook uses is bound as a default argument (immutable values and builtins captured before the
# program runs): no globals, no closures, nothing the program can monkeypatch.
_PRELUDE = r'''
import sys, posix


def _lmforge_limits(memory, cpu, fsize, nofile):
    import resource

    for res, soft, hard in (
        (resource.RLIMIT_AS, memory, memory),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_NOFILE, nofile, nofile),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        cap = resource.getrlimit(res)[1]
        if cap != resource.RLIM_INFINITY:
            soft, hard = min(soft, cap), min(hard, cap)
        resource.setrlimit(res, (soft, hard))


def _lmforge_hook(work):
    def norm(path, dir_fd, dotdot_ok, _type=type, _str=str, _bytes=bytes, _int=int, _list=list,
             _fspath=posix.fspath, _getcwd=posix.getcwd, _readlink=posix.readlink):
        """`path` (relative to dir_fd or the cwd) made absolute and normalised, or None when that
        cannot be told. Lexical, which is exact inside the sandbox because no links can be made there."""
        original = path
        if _type(path) is _int:
            path = _readlink("/proc/self/fd/" + _str(path))
        elif _type(path) is not _str and _type(path) is not _bytes:
            path = _fspath(path)
        if _type(path) is _bytes:
            path = _bytes.decode(path, "utf-8", "surrogateescape")
        if _type(path) is not _str:
            return None
        if _type(original) is _int and not _str.startswith(path, "/"):
            return None  # a pipe, socket or anonymous file
        if not _str.startswith(path, "/"):
            # os.open's event hides its dir_fd: a relative '..' there could climb out of any directory
            if not dotdot_ok and ".." in _str.split(path, "/"):
                return None
            if _type(dir_fd) is _int and dir_fd >= 0:
                base = _readlink("/proc/self/fd/" + _str(dir_fd))
                if not _str.startswith(base, "/"):
                    return None
                path = base + "/" + path
            else:
                path = _getcwd() + "/" + path
        parts = _list()
        for part in _str.split(path, "/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + _str.join("/", parts)

    def inside(path, _type=type, _str=str, _root=work, _prefix=work + "/"):
        return _type(path) is _str and (path == _root or _str.startswith(path, _prefix))

    def deny(why, event, args, _type=type, _str=str, _bytes=bytes, _int=int, _list=list, _repr=repr,
             _write=posix.write, _exit=posix._exit, _code=EXIT_FORBIDDEN, _marker=MARKER):
        shown = _list()
        for arg in args:
            if _type(arg) is _str or _type(arg) is _bytes or _type(arg) is _int:
                shown.append(_repr(arg)[:120])
            else:
                shown.append("...")
        line = "\n" + _marker + "forbidden: " + why + " (" + event + " " + _str.join(", ", shown) + ")\n"
        try:
            _write(2, _str.encode(line, "utf-8", "backslashreplace"))
        finally:
            _exit(_code)

    def isdir(path, _stat=posix.stat):
        try:
            return (_stat(path).st_mode & 0o170000) == 0o040000
        except OSError:
            return False

    always = (
        ("subprocess.Popen", "no new processes"), ("os.system", "no new processes"),
        ("os.exec", "no new processes"), ("os.posix_spawn", "no new processes"),
        ("os.fork", "no new processes"), ("os.forkpty", "no new processes"),
        ("cpython.PyInterpreterState_New", "no sub-interpreters"),
        ("os.kill", "no signals to other processes"), ("os.killpg", "no signals to other processes"),
        ("os.symlink", "no links"), ("os.link", "no links"),
        ("resource.setrlimit", "the limits are fixed"), ("resource.prlimit", "the limits are fixed"),
        ("_posixsubprocess.fork_exec", "no new processes"),
    )
    always_names = frozenset(name for name, _ in always)
    imports = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_testcapi", "_testinternalcapi",
                         "_xxsubinterpreters"})
    writes = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND

    def hook(event, args, _norm=norm, _inside=inside, _deny=deny, _isdir=isdir, _always=always,
             _always_names=always_names, _imports=imports, _writes=writes, _type=type, _str=str,
             _int=int, _function=type(norm), _devices=("/dev/null", "/dev/stdout", "/dev/stderr"),
             _MemoryError=MemoryError, _BaseException=BaseException):
        try:
            if event == "open":
                path, mode, flags = args
                if _type(path) is _int:
                    return  # an fd the program already holds: its own open was checked
                if _type(flags) is _int:
                    writing = flags & _writes
                else:
                    writing = _type(mode) is _str and (
                        "w" in mode or "a" in mode or "x" in mode or "+" in mode
                    )
                where = _norm(path, -1, mode is not None)
                if writing and not _inside(where) and where not in _devices:
                    _deny("writing outside the sandbox", event, args)
                if mode is None and not _inside(where) and (where is None or _isdir(where)):
                    _deny("directory handles outside the sandbox (dir_fd writes)", event, args)
            elif event in ("os.remove", "os.rmdir", "shutil.rmtree", "os.mkdir", "os.chmod", "os.chown",
                           "os.utime", "os.rename", "os.truncate", "os.setxattr", "os.removexattr"):
                if event == "os.rename":
                    spots = ((0, 2), (1, 3))
                elif event == "os.mkdir" or event == "os.chmod":
                    spots = ((0, 2),)
                elif event == "os.chown" or event == "os.utime":
                    spots = ((0, 3),)
                elif event == "os.remove" or event == "os.rmdir" or event == "shutil.rmtree":
                    spots = ((0, 1),)
                else:
                    spots = ((0, -1),)
                for at, dir_fd_at in spots:
                    if not _inside(_norm(args[at], args[dir_fd_at] if dir_fd_at >= 0 else -1, True)):
                        _deny("changing files outside the sandbox", event, args)
            elif event == "import":
                name, filename = args[0], args[1]
                if _type(name) is _str and _str.partition(name, ".")[0] in _imports:
                    _deny("this module is blocked", event, args[:2])
                if filename is not None and _inside(_norm(filename, -1, True)):
                    _deny("no C extensions from the sandbox", event, args[:2])
            elif event in _always_names:
                for name, why in _always:
                    if name == event:
                        _deny(why, event, args)
            elif _str.startswith(event, "socket."):
                # an AF_UNIX socket that never connects or binds is a local pipe (asyncio's self-pipe)
                if not (event == "socket.__new__" and args[1] == 1):
                    _deny("no network", event, args)
            elif _str.startswith(event, "ctypes."):
                _deny("no ctypes", event, ())
            elif event == "object.__setattr__":
                # the sandbox's own functions only: the standard library sets __defaults__ too (namedtuple)
                if (
                    _type(args[0]) is _function
                    and args[1] in ("__code__", "__defaults__", "__kwdefaults__")
                    and args[0].__code__.co_filename == "<lmforge-sandbox>"
                ):
                    _deny("no rewiring of the sandbox", event, args[1:2])
        except _MemoryError:
            raise
        except _BaseException:
            _deny("the sandbox could not check this", event, ())

    return hook


def _lmforge_describe(exc, source):
    """One line naming the exception and the program line it came from; prints the traceback."""
    name = type(exc).__name__
    try:
        message = str(exc.msg if isinstance(exc, SyntaxError) else exc)
    except BaseException:
        message = ""
    line = exc.lineno if isinstance(exc, SyntaxError) and exc.filename == "<program>" else None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<program>":
            line = tb.tb_lineno
        tb = tb.tb_next
    detail = name + (": " + message if message else "")
    lines = source.splitlines()
    if line and 0 < line <= len(lines):
        detail += " (line " + str(line) + ": " + lines[line - 1].strip() + ")"
    try:
        import linecache, traceback

        linecache.cache["<program>"] = (len(source), None, source.splitlines(True), "<program>")
        posix.write(2, "".join(traceback.format_exception(exc)).encode("utf-8", "backslashreplace"))
    except BaseException:
        pass
    return " ".join(detail.split())[:300]


def _lmforge_main(_exit=posix._exit, _write=posix.write):
    work, program_path = sys.argv[1], sys.argv[2]
    _lmforge_limits(*(int(arg) for arg in sys.argv[3:7]))
    with open(program_path, encoding="utf-8") as f:
        source = f.read()
    sys.argv[:] = ["<program>"]
    # fork_exec forks and execs without an audit event: swap it before anything can take a reference
    # (subprocess and multiprocessing then get the stand-in); re-creating the module is then blocked
    import _posixsubprocess

    def fork_exec(*args, _audit=sys.audit):
        _audit("_posixsubprocess.fork_exec")
        raise OSError("no new processes")

    _posixsubprocess.fork_exec = fork_exec
    del fork_exec, _posixsubprocess
    sys.addaudithook(_lmforge_hook(work))
    code, detail = 0, ""
    try:
        program = compile(source, "<program>", "exec", dont_inherit=True)
        module = type(sys)("__main__")
        sys.modules["__main__"] = module
        exec(program, module.__dict__)
    except SystemExit as exc:
        if exc.code is not None and exc.code != 0:
            code, detail = EXIT_ERROR, "SystemExit: " + " ".join(repr(exc.code).split())[:200]
    except MemoryError:
        code, detail = EXIT_MEMORY, "MemoryError"  # no traceback: the memory may still be held
    except BaseException as exc:
        code = EXIT_FAILED if isinstance(exc, AssertionError) else EXIT_ERROR
        try:
            detail = _lmforge_describe(exc, source)
        except MemoryError:
            code, detail = EXIT_MEMORY, "MemoryError"
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:
            pass
    if detail:
        try:
            _write(2, ("\n" + MARKER + detail + "\n").encode("utf-8", "backslashreplace"))
        except BaseException:
            pass
    _exit(code)


_lmforge_main()
'''
_PRELUDE = (
    f"EXIT_FAILED, EXIT_ERROR, EXIT_MEMORY, EXIT_FORBIDDEN = "
    f"{_EXIT_FAILED}, {_EXIT_ERROR}, {_EXIT_MEMORY}, {_EXIT_FORBIDDEN}\nMARKER = {_MARKER!r}\n" + _PRELUDE
)
# compiled under a file name of its own, by which the hook knows the sandbox's functions
_PRELUDE = f"exec(compile({_PRELUDE!r}, '<lmforge-sandbox>', 'exec'))"


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
    source: str, *, timeout_s: float = 5.0, memory_mb: int = 512, output_limit: int = OUTPUT_LIMIT
) -> Outcome:
    """Run `source` in a sandboxed subprocess (see the module docstring) and classify how it ended:
    passed (exit 0), failed (AssertionError), error (another exception, a syntax error, a non-zero
    exit, a signal), timeout (wall clock `timeout_s` or the CPU limit), memory (MemoryError under the
    `memory_mb` address-space limit), forbidden (the audit hook stopped it)."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb < 64:
        raise ValueError(f"memory_mb must be >= 64 (Python itself needs some), got {memory_mb}")
    if output_limit < 0:
        raise ValueError(f"output_limit must be >= 0, got {output_limit}")
    root = os.path.realpath(tempfile.mkdtemp(prefix="lmforge-sandbox-"))
    try:
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        program = os.path.join(root, "program.py")  # beside cwd, not in it: readable, not writable
        with open(program, "w", encoding="utf-8", errors="replace") as f:
            f.write(source)
        limits = [memory_mb * 2**20, math.ceil(timeout_s) + 1, FILE_SIZE_LIMIT, OPEN_FILES_LIMIT]
        argv = [sys.executable, "-I", "-S", "-c", _PRELUDE, work, program, *map(str, limits)]
        env = {"HOME": work, "TMPDIR": work, "MALLOC_ARENA_MAX": "2"}  # arenas eat RLIMIT_AS per thread
        rc, timed_out, stdout, stderr, seconds = _execute(argv, work, env, timeout_s, output_limit)
    finally:
        _remove_tree(root)
    status, detail = _classify(rc, timed_out, stderr, timeout_s, limits[1])
    return Outcome(status, detail, seconds, stdout, stderr)


def run_many(
    sources: Sequence[str],
    *,
    workers: int = 2,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    output_limit: int = OUTPUT_LIMIT,
) -> list[Outcome]:
    """`run_program` over `sources`, `workers` at a time (threads driving subprocesses); the outcomes
    come back in the order of `sources`."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not sources:
        return []
    run = lambda source: run_program(
        source, timeout_s=timeout_s, memory_mb=memory_mb, output_limit=output_limit
    )
    with ThreadPoolExecutor(max_workers=min(workers, len(sources)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(run, sources))


def pass_at_k_scores(
    outcomes_per_problem: Sequence[Sequence[Outcome]], ks: Sequence[int] = (1, 5, 10)
) -> dict[str, float]:
    """{"pass@k": mean over problems of the unbiased pass@k (Chen et al. 2021) from each problem's n
    samples and c passes}. A problem with fewer than k samples is left out of pass@k's mean, and a k
    that no problem reaches has no key. The Codex / HumanEval convention reports pass@k only when every
    problem has n >= k: give every problem at least max(ks) samples for numbers comparable to papers."""
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
    argv: list[str], cwd: str, env: dict[str, str], timeout_s: float, output_limit: int
) -> tuple[int, bool, str, str, float]:
    """Run argv in a new session, reading its output until it exits or the deadline passes; then
    SIGKILL its whole process group (before reaping the leader, so the group id cannot have been
    reused). Returns (returncode, timed_out, stdout, stderr, seconds)."""
    start = time.monotonic()
    deadline = start + timeout_s
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
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
    marked = [line[len(_MARKER) :] for line in stderr.splitlines() if line.startswith(_MARKER)]
    detail = marked[-1] if marked else ""
    if timed_out:
        return "timeout", f"still running after {timeout_s:g} s"
    if rc == 0:
        return "passed", ""
    if rc == _EXIT_FAILED:
        return "failed", detail or "AssertionError"
    if rc == _EXIT_MEMORY:
        return "memory", detail or "MemoryError"
    if rc == _EXIT_FORBIDDEN:
        return "forbidden", detail or "forbidden"
    if rc == _EXIT_ERROR:
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
