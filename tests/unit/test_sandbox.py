"""The sandboxed executor for model-written Python: statuses, limits, what the audit hook blocks (the
second layer, alone as under --unsafe-code-exec), the temp dir and process-group clean-up, concurrency,
and pass@k over outcomes. tests/hostile/test_sandbox_escapes.py tries to get out of the whole sandbox."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time

import pytest

from lmforge.eval.metrics import pass_at_k
from lmforge.eval.sandbox import Outcome, _execute, pass_at_k_scores, run_many, run_program

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only"),
    pytest.mark.usefixtures("code_sandbox"),  # skipped, saying what to install, without bubblewrap
]


def _gone(pid: int, wait_s: float = 2.0) -> bool:
    """The process stops running within wait_s (SIGKILL lands asynchronously): it is absent or a zombie
    waiting for a reaper."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


# ------------------------------------------------------------------------------------------ statuses


def test_correct_program_passes_and_its_output_is_captured():
    out = run_program("import math\nprint(math.factorial(5))\n", timeout_s=2)
    assert (out.status, out.detail, out.stdout) == ("passed", "", "120\n")
    assert out.passed and 0 < out.seconds < 2


def test_failing_assert_is_failed_with_the_assert_line_and_message():
    bare = run_program("def f(a, b):\n    return a - b\nassert f(2, 3) == 5\n", timeout_s=2)
    assert bare.status == "failed"
    assert bare.detail == "AssertionError (line 3: assert f(2, 3) == 5)"
    assert "Traceback" in bare.stderr and "assert f(2, 3) == 5" in bare.stderr
    told = run_program("assert 1 + 1 == 3, 'wrong sum'\n", timeout_s=2)
    assert told.status == "failed" and told.detail.startswith("AssertionError: wrong sum (line 1:")


@pytest.mark.parametrize(
    "source, detail",
    [
        ("def f(:\n    pass\n", "SyntaxError: invalid syntax (line 1: def f(:)"),
        ("x = 1\nraise ValueError('boom')\n", "ValueError: boom (line 2: raise ValueError('boom'))"),
        ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
        ("import os\nos._exit(7)\n", "exit status 7"),
        ("input()\n", "EOFError: EOF when reading a line (line 1: input())"),  # stdin is /dev/null
    ],
)
def test_exceptions_and_non_zero_exits_are_errors(source, detail):
    out = run_program(source, timeout_s=2)
    assert (out.status, out.detail) == ("error", detail)


def test_exit_zero_passes():
    assert run_program("import sys\nsys.exit(0)\nassert False\n", timeout_s=2).status == "passed"


def test_infinite_loop_times_out_within_a_bounded_wall_time():
    start = time.monotonic()
    out = run_program("while True:\n    pass\n", timeout_s=1.0)
    assert out.status == "timeout" and out.detail == "still running after 1 s"
    assert 1.0 <= out.seconds < 1.5 and time.monotonic() - start < 2.5


def test_huge_allocation_hits_the_memory_limit():
    out = run_program("x = bytearray(2 * 1024**3)\n", timeout_s=2, memory_mb=256)
    assert (out.status, out.detail) == ("memory", "MemoryError")


def test_large_output_is_cut_in_the_middle_but_the_program_passes():
    out = run_program("print('a' * 500_000 + 'b' * 500_000)\n", timeout_s=5, output_limit=10_000)
    assert out.status == "passed"
    assert len(out.stdout) < 10_100 and "bytes cut" in out.stdout
    assert out.stdout.startswith("a" * 5_000) and out.stdout.endswith("b" * 4_999 + "\n")


def test_the_detail_line_survives_a_flood_on_stderr():
    out = run_program("import sys\nsys.stderr.write('e' * 100_000)\nassert 0, 'late'\n", timeout_s=2)
    assert out.status == "failed" and out.detail.startswith("AssertionError: late")


# -------------------------------------------------------------------------------------- isolation


@pytest.mark.parametrize(
    "source, why",
    [
        ("import socket\nsocket.create_connection(('127.0.0.1', 9))\n", "no network"),
        ("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))\n", "no network"),
        ("import subprocess\nsubprocess.run(['echo'])\n", "no new processes"),
        ("import os\nos.system('true')\n", "no new processes"),
        ("import os, time\nif os.fork() == 0:\n    time.sleep(30)\n", "no new processes"),
        ("import _posixsubprocess\n_posixsubprocess.fork_exec()\n", "no new processes"),
        ("import multiprocessing\nmultiprocessing.Pool(2).map(abs, [1, -2])\n", "no new processes"),
        ("import os\nos.kill(1, 0)\n", "no signals to other processes"),
        ("import ctypes\n", "this module is blocked"),
        (
            "import glob, importlib.machinery as m, importlib.util as u, sysconfig\n"
            "f = glob.glob(sysconfig.get_path('platstdlib') + '/lib-dynload/_posixsubprocess*')[0]\n"
            "u.module_from_spec(u.spec_from_file_location('x._posixsubprocess', f, "
            "loader=m.ExtensionFileLoader('x._posixsubprocess', f)))\n",
            "this module is blocked",
        ),
        ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n", "the limits are fixed"),
        ("import shutil\nshutil.rmtree('/tmp/lmforge-no-such-dir')\n", "changing files outside"),
        ("import os\nos.symlink('/etc', 'etc')\n", "no links"),
        ("import os\nfd = os.open('/etc', os.O_RDONLY)\n", "directory handles outside"),
    ],
)
def test_blocked_operations_are_forbidden_even_when_caught(source, why):
    # a broad except around the attempt must not turn "forbidden" into anything else
    body = "".join("    " + line + "\n" for line in source.splitlines())
    program = f"try:\n{body}except BaseException:\n    pass\nprint('went on')\n"
    out = run_program(program, timeout_s=3, isolation="hook")
    assert out.status == "forbidden", out
    assert out.detail.startswith("forbidden: " + why), out.detail
    assert "went on" not in out.stdout


def test_writing_outside_the_sandbox_is_forbidden_and_nothing_is_written(tmp_path):
    for i, source in enumerate(
        [
            "open({path!r}, 'w').write('x')",
            "import pathlib\npathlib.Path({path!r}).write_text('x')",
            "import os\nos.close(os.open({path!r}, os.O_WRONLY | os.O_CREAT))",
            "import os\nos.chdir({dir!r})\nopen('x_outside_{i}', 'w')",
        ]
    ):
        target = tmp_path / f"x_outside_{i}"
        source = source.format(path=str(target), dir=str(tmp_path), i=i)
        out = run_program(source, timeout_s=2, isolation="hook")
        assert out.status == "forbidden" and "writing outside the sandbox" in out.detail, out
        assert not target.exists()


def test_relative_dotdot_through_a_dir_fd_cannot_climb_out():
    # os.open's audit event hides dir_fd: a '..' path there is refused whatever the cwd says
    source = (
        "import os\nos.makedirs('a/b/c')\nfd = os.open('.', os.O_RDONLY)\nos.chdir('a/b/c')\n"
        "os.open('../../../../x_escape', os.O_WRONLY | os.O_CREAT, dir_fd=fd)\n"
    )
    out = run_program(source, timeout_s=2, isolation="hook")
    assert out.status == "forbidden" and "writing outside the sandbox" in out.detail


def test_the_sandbox_cannot_be_rewired_through_gc():
    source = (
        "import gc, types\n"
        "fs = [o for o in gc.get_objects() if isinstance(o, types.FunctionType) and o.__name__ == 'inside']\n"
        "fs[0].__defaults__ = (type, str, '/', '/')\n"
        "open('/tmp/lmforge-rewired', 'w')\n"
    )
    out = run_program(source, timeout_s=2, isolation="hook")
    assert out.status == "forbidden" and "no rewiring" in out.detail
    assert not os.path.exists("/tmp/lmforge-rewired")


def test_writing_inside_is_allowed_and_the_temp_dir_is_removed_afterwards():
    source = (
        "import os, tempfile, pathlib\n"
        "open('f.txt', 'w').write('hello')\n"
        "os.makedirs('d/e')\n"
        "pathlib.Path('d/e/g.txt').write_text('x')\n"
        "with tempfile.NamedTemporaryFile('w') as t:\n"  # TMPDIR is the sandbox
        "    t.write('y')\n"
        "os.chmod('d', 0)\n"  # the clean-up must cope with this
        "print(open('f.txt').read(), os.getcwd())\n"
    )
    out = run_program(source, timeout_s=3, isolation="hook")
    assert out.status == "passed", out
    text, cwd = out.stdout.split()
    assert text == "hello" and os.path.basename(os.path.dirname(cwd)).startswith("lmforge-sandbox-")
    assert not os.path.exists(os.path.dirname(cwd))
    # in the OS sandbox the program writes in its own /work (cwd, HOME) and /tmp, which vanish with it
    before = set(os.listdir(tempfile.gettempdir()))
    out = run_program(source.replace("print(", "open('/tmp/t', 'w').write('z')\nprint("), timeout_s=3)
    assert (out.status, out.stdout) == ("passed", "hello /work\n"), out
    left = set(os.listdir(tempfile.gettempdir())) - before
    assert not {n for n in left if n.startswith("lmforge-sandbox-")}


def test_the_standard_library_still_works():
    source = (
        "import asyncio, collections, dataclasses, json, re, threading\n"
        "P = collections.namedtuple('P', 'x y', defaults=(0,))\n"
        "@dataclasses.dataclass\nclass A:\n    x: int = 1\n"
        "async def main():\n    return 3\n"
        "ts = [threading.Thread(target=sum, args=(range(1000),)) for _ in range(4)]\n"
        "[t.start() for t in ts]\n[t.join() for t in ts]\n"
        "print(P(1), A(), asyncio.run(main()), json.dumps(re.findall('a', 'aa')))\n"
    )
    out = run_program(source, timeout_s=5)
    assert (out.status, out.stdout) == ("passed", 'P(x=1, y=0) A(x=1) 3 ["a", "a"]\n')


def test_the_whole_process_group_is_killed(tmp_path):
    # not through the hook (which forbids processes): the harness's own kill, with a plain python
    def spawn_grandchild(then: str) -> str:
        return (
            "import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open('pid', 'w').write(str(p.pid))\n{then}\n"
        )

    # the child times out: the grandchild dies with it
    start = time.monotonic()
    rc, timed_out, *_ = _execute(
        [sys.executable, "-c", spawn_grandchild("time.sleep(60)")], str(tmp_path), {}, 1.0, 1000
    )
    assert timed_out and time.monotonic() - start < 2.5
    assert _gone(int((tmp_path / "pid").read_text()))
    # the child exits at once while the grandchild holds its pipes: no waiting for the deadline either
    start = time.monotonic()
    rc, timed_out, *_ = _execute([sys.executable, "-c", spawn_grandchild("")], str(tmp_path), {}, 10.0, 1000)
    assert (rc, timed_out) == (0, False) and time.monotonic() - start < 3
    assert _gone(int((tmp_path / "pid").read_text()))


# ------------------------------------------------------------------------------ tasks and pass@k


def test_humaneval_style_program():
    prompt = "def add(a, b):\n"
    test = "def check(f):\n    assert f(2, 3) == 5\ncheck(add)\n"
    right, wrong = run_many([prompt + "    return a + b\n" + test, prompt + "    return a - b\n" + test])
    assert right.status == "passed"
    assert (wrong.status, wrong.detail) == ("failed", "AssertionError (line 4: assert f(2, 3) == 5)")


def test_run_many_keeps_order_and_runs_concurrently():
    sources = [f"import time\ntime.sleep(0.5)\nprint({i})\n" for i in range(4)]
    start = time.monotonic()
    outs = run_many(sources, workers=2, timeout_s=5)
    elapsed = time.monotonic() - start
    assert [o.stdout for o in outs] == ["0\n", "1\n", "2\n", "3\n"]
    assert all(o.passed for o in outs) and elapsed < 1.6
    assert run_many([]) == []


def test_pass_at_k_scores_average_over_problems_and_skip_short_ones():
    ok, bad = Outcome("passed", "", 0.1), Outcome("failed", "AssertionError", 0.1)
    problems = [[ok] * 3 + [bad] * 7, [ok], [bad, Outcome("timeout", "", 1.0)]]
    scores = pass_at_k_scores(problems, ks=(1, 2, 5, 10, 20))
    assert scores["pass@1"] == pytest.approx((0.3 + 1.0 + 0.0) / 3)
    assert scores["pass@2"] == pytest.approx((pass_at_k(10, 3, 2) + 0.0) / 2)  # the n=1 problem is left out
    assert scores["pass@5"] == pytest.approx(pass_at_k(10, 3, 5))
    assert scores["pass@10"] == 1.0 and "pass@20" not in scores
    assert pass_at_k_scores([]) == {}
    with pytest.raises(ValueError, match="k >= 1"):
        pass_at_k_scores(problems, ks=(0,))


def test_outcome_is_frozen_and_arguments_are_checked():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Outcome("passed", "", 0.0).status = "failed"  # type: ignore[misc]
    with pytest.raises(ValueError, match="timeout_s"):
        run_program("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_program("pass", memory_mb=8)
    with pytest.raises(ValueError, match="workers"):
        run_many(["pass"], workers=0)
