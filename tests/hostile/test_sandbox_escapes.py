"""Getting out of the pass@k sandbox (eval/sandbox/): every attack is run three ways.

- plain: the same program in a bare `python -I -S` on the host, which must SUCCEED (so each test can fail:
  the attack is real and the check sees its effect);
- the operating-system layer alone (bubblewrap namespaces, the unprivileged user, seccomp, rlimits; no
  audit hook), which must hold on its own;
- the whole sandbox (both layers), as `lmforge eval` runs it.

The effects are looked for on the host, not taken from the program's word: a file written or changed
outside, a process still alive after the run, a connection a listening socket accepted, a signal a victim
process received, a secret (an environment variable of the harness, a root-only file) in the output.
The host dir the attacks aim at is world-writable and its files 0666, so that only the sandbox, not file
permissions, stands in the way.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmforge.eval.sandbox import _run, run_program

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only"),
    pytest.mark.usefixtures("code_sandbox"),  # skipped, saying what to install, without bubblewrap
]

TIMEOUT_S = 4.0
SECRET = "lmforge-test-secret-" + uuid.uuid4().hex


@dataclass
class Host:
    """What the attacks aim at, and how to see whether they got there."""

    dir: Path  # world-writable, outside the sandbox
    token: str  # marks processes the attacks start
    port: int  # a TCP server on 127.0.0.1
    abstract: str  # an abstract unix socket name
    accepted: list  # what the servers received
    victim: subprocess.Popen | None = None

    def spawn_victim(self) -> int:
        self.victim = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)", "victim-" + self.token],
            start_new_session=True,  # its own process group: killpg must reach it and nothing else
        )
        time.sleep(0.2)
        return self.victim.pid

    def tagged_processes(self) -> list[int]:
        """Live processes carrying the token (zombies awaiting a reaper are dead)."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if self.token.encode() in cmd and b"victim-" not in cmd and state not in ("Z", "X"):
                found.append(int(pid))
        return found


@pytest.fixture
def host(tmp_path, monkeypatch):
    target = tmp_path / "outside"
    target.mkdir()
    os.chmod(tmp_path, 0o777)
    os.chmod(target, 0o777)
    (target / "existing.txt").write_text("original\n")
    os.chmod(target / "existing.txt", 0o666)
    (target / "secret.txt").write_text(SECRET + "\n")
    os.chmod(target / "secret.txt", 0o600)
    monkeypatch.setenv("LMFORGE_API_KEY", SECRET)  # the harness's environment: must not leak
    accepted: list = []
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract = "lmforge-test-" + uuid.uuid4().hex
    unix.bind("\0" + abstract)
    unix.listen()
    stop = threading.Event()

    def serve(server):
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(1)
                try:
                    accepted.append(conn.recv(100))
                except OSError:
                    accepted.append(b"")

    threads = [threading.Thread(target=serve, args=(s,), daemon=True) for s in (tcp, unix)]
    for t in threads:
        t.start()
    h = Host(target, uuid.uuid4().hex, tcp.getsockname()[1], abstract, accepted)
    yield h
    stop.set()
    for t in threads:
        t.join()
    tcp.close()
    unix.close()
    for pid in h.tagged_processes():
        os.kill(pid, signal.SIGKILL)
    if h.victim is not None:
        h.victim.kill()
        h.victim.wait()


# The attacks: Python source with {dir}, {token}, {port}, {abstract}, {victim} filled in. Each tries every
# way it knows and goes on after a failure, so one refused path does not hide another.
PRELUDE = """
import os, sys
def attempt(name, fn):
    try:
        fn()
        print("done:", name, flush=True)
    except BaseException as e:
        print("failed:", name, type(e).__name__, str(e)[:100], flush=True)
"""

OUTLIVE = """
import importlib.machinery, importlib.util, glob, subprocess, sysconfig, time
cmd = [sys.executable, "-c", "import time; time.sleep(20)", "{token}"]
def reloaded_fork_exec():
    # _posixsubprocess a second time under another dotted name: a fork_exec nobody swapped or audits
    path = glob.glob(os.path.join(sysconfig.get_path("platstdlib"), "lib-dynload", "_posixsubprocess*"))[0]
    loader = importlib.machinery.ExtensionFileLoader("evil._posixsubprocess", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(
        "evil._posixsubprocess", path, loader=loader))
    subprocess._fork_exec = module.fork_exec
    subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
def double_fork():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(cmd[0], cmd)
        os._exit(0)
def spawn():
    os.posix_spawn(cmd[0], cmd, {{}}, setsid=True)
attempt("reloaded _posixsubprocess", reloaded_fork_exec)
attempt("double fork", double_fork)
attempt("posix_spawn", spawn)
time.sleep(30)  # past the deadline: the harness kills the sandbox
"""

WRITE = """
import shutil, sqlite3, mmap, pathlib
d = "{dir}"
def via_open():
    open(d + "/open.txt", "w").write("x")
def via_pathlib():
    pathlib.Path(d, "pathlib.txt").write_text("x")
def via_os_open():
    os.close(os.open(d + "/osopen.txt", os.O_WRONLY | os.O_CREAT))
def via_sqlite():
    sqlite3.connect(d + "/sqlite.db").execute("create table t(x)")
def via_sqlite_attach():
    c = sqlite3.connect(":memory:")
    c.execute("attach database '" + d + "/attach.db' as a")
    c.execute("create table a.t(x)")
def via_vacuum_into():
    c = sqlite3.connect(":memory:")
    c.execute("create table t(x)")
    c.execute("vacuum into '" + d + "/vacuum.db'")
def via_mkfifo():
    os.mkfifo(d + "/fifo")
def via_mknod():
    os.mknod(d + "/node")
def via_link():
    open("mine", "w").write("x")
    os.link("mine", d + "/hardlink")
def via_symlink():
    os.symlink("/etc/passwd", d + "/symlink")
def via_rename():
    open("mine2", "w").write("x")
    os.rename("mine2", d + "/renamed")
def via_shutil():
    open("mine3", "w").write("x")
    shutil.copy("mine3", d + "/copied")
def via_mmap():
    with open(d + "/existing.txt", "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
        m[:8] = b"CHANGED!"
        m.flush()
def via_ctypes_renamed():
    # _ctypes loaded under another name, then libc's open and write
    import importlib.machinery, importlib.util, glob, sysconfig
    path = glob.glob(os.path.join(sysconfig.get_path("platstdlib"), "lib-dynload", "_ctypes*"))[0]
    spec = importlib.util.spec_from_file_location(
        "evil._ctypes", path, loader=importlib.machinery.ExtensionFileLoader("evil._ctypes", path))
    sys.modules["_ctypes"] = importlib.util.module_from_spec(spec)
    import ctypes
    libc = ctypes.CDLL(None)
    fd = libc.open((d + "/ctypes.txt").encode(), 0o101, 0o644)
    assert fd >= 0, "open failed"
    libc.write(fd, b"x", 1)
for name, fn in list(globals().items()):
    if name.startswith("via_"):
        attempt(name, fn)
"""

READ = """
import glob
def parent_environ():
    print(open("/proc/%d/environ" % os.getppid(), "rb").read())
def every_environ():
    for p in glob.glob("/proc/[0-9]*/environ"):
        try:
            print(open(p, "rb").read())
        except OSError:
            pass
def root_only_file():
    print(open("{dir}/secret.txt").read())
def shadow():
    print(open("/etc/shadow").read()[:40])
attempt("parent environ", parent_environ)
attempt("every environ", every_environ)
attempt("root-only file", root_only_file)
attempt("shadow", shadow)
"""

NETWORK = """
import socket
def tcp():
    s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
    s.sendall(b"hello tcp")
    s.close()
def abstract_unix():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect("\\0{abstract}")
    s.sendall(b"hello unix")
    s.close()
attempt("tcp to 127.0.0.1", tcp)
attempt("abstract unix socket", abstract_unix)
"""

SIGNAL = """
import signal
def kill():
    os.kill({victim}, signal.SIGTERM)
def pidfd():
    fd = os.pidfd_open({victim})
    signal.pidfd_send_signal(fd, signal.SIGTERM)
def group():
    os.killpg(os.getpgid({victim}), signal.SIGTERM)
attempt("kill", kill)
attempt("pidfd", pidfd)
attempt("killpg", group)
"""


def run(mode: str, source: str, tmp_path: Path, timeout_s: float = TIMEOUT_S) -> str:
    """The program's stdout + stderr when run `mode` (plain, os, both)."""
    program = textwrap.dedent(PRELUDE) + textwrap.dedent(source)
    if mode == "plain":
        cwd = tmp_path / "plain-cwd"
        cwd.mkdir(exist_ok=True)
        try:
            p = subprocess.run(
                [sys.executable, "-I", "-S", "-c", program], cwd=cwd, capture_output=True, text=True,
                timeout=timeout_s,
            )  # fmt: skip
            return p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            return (e.stdout or b"").decode() + (e.stderr or b"").decode()
    if mode == "os":
        out = _run(program, timeout_s, 256, 100_000, os_layer=True, hook=False)
    else:
        out = run_program(program, timeout_s=timeout_s, memory_mb=256, output_limit=100_000)
    return f"[{out.status}: {out.detail}]\n" + out.stdout + out.stderr


MODES = ("plain", "os", "both")


def _expect(mode: str, escaped: bool, output: str) -> None:
    if mode == "plain":
        assert escaped, f"the attack did not work even without the sandbox:\n{output[-3000:]}"
    else:
        assert not escaped, f"escaped the sandbox ({mode}):\n{output[-3000:]}"


@pytest.mark.parametrize("mode", MODES)
def test_no_process_outlives_the_sandbox(mode, host, tmp_path):
    output = run(mode, OUTLIVE.format(token=host.token), tmp_path, timeout_s=2.0)
    time.sleep(0.5)
    _expect(mode, bool(host.tagged_processes()), output)


@pytest.mark.parametrize("mode", MODES)
def test_nothing_outside_is_written_by_any_file_opening_path(mode, host, tmp_path):
    output = run(mode, WRITE.format(dir=host.dir), tmp_path)
    created = sorted(p.name for p in host.dir.iterdir() if p.name not in ("existing.txt", "secret.txt"))
    changed = (host.dir / "existing.txt").read_text() != "original\n"
    if mode == "plain":  # every path works on the host (as root, mknod and links too)
        assert len(created) >= 12 and changed, (created, output)
    _expect(mode, bool(created) or changed, output + f"\ncreated {created}, existing changed: {changed}")


@pytest.mark.parametrize("mode", MODES)
def test_the_harness_environment_and_private_files_stay_unread(mode, host, tmp_path):
    output = run(mode, READ.format(dir=host.dir), tmp_path)
    _expect(mode, SECRET in output, output)


@pytest.mark.parametrize("mode", MODES)
def test_no_network_to_the_host(mode, host, tmp_path):
    output = run(mode, NETWORK.format(port=host.port, abstract=host.abstract), tmp_path)
    time.sleep(0.3)
    _expect(mode, bool(host.accepted), output + f"\nreceived: {host.accepted}")


@pytest.mark.parametrize("mode", MODES)
def test_no_signal_reaches_another_process(mode, host, tmp_path):
    victim = host.spawn_victim()
    output = run(mode, SIGNAL.format(victim=victim), tmp_path)
    time.sleep(0.2)
    _expect(mode, host.victim.poll() is not None, output)


@pytest.mark.parametrize("mode", MODES)
def test_a_fork_bomb_is_bounded(mode, tmp_path):
    source = """
    import threading, time
    forks = threads = 0
    try:
        for _ in range(60):
            if os.fork() == 0:
                time.sleep(0.5)
                os._exit(0)
            forks += 1
    except BaseException as e:
        print("fork:", type(e).__name__)
    try:
        for _ in range(60):
            threading.Thread(target=time.sleep, args=(0.5,), daemon=True).start()
            threads += 1
    except BaseException as e:
        print("thread:", type(e).__name__)
    print("forks", forks, "threads", threads, flush=True)
    """
    output = run(mode, source, tmp_path)
    counts = output.split("forks ")[-1].split() if "forks " in output else ["0", "threads", "0"]
    forks, threads = int(counts[0]), int(counts[2])
    if mode == "plain":
        assert forks == 60 and threads == 60, output
    else:
        assert forks == 0 and threads < 32, output  # the first fork is refused; threads stop at the limit


@pytest.mark.parametrize("mode", MODES)
def test_filling_the_disk_stops_at_the_sandbox_size(mode, tmp_path):
    source = """
    total = 0
    for d in (".", "/tmp"):
        try:
            for i in range(8):
                with open(os.path.join(d, "fill%d" % i), "wb") as f:
                    for _ in range(5):
                        f.write(b"x" * 2**20)
                        total += 2**20
        except BaseException as e:
            print(d, type(e).__name__)
    print("wrote", total // 2**20, "MiB", flush=True)
    """
    before = _disk_free(tmp_path)
    output = run(mode, source, tmp_path)
    wrote = int(output.split("wrote ")[-1].split()[0]) if "wrote " in output else 0
    if mode == "plain":
        assert wrote == 80, output
    else:
        assert wrote <= 20, output  # the 16 MiB /work and the 4 MiB /tmp, in memory
        assert before - _disk_free(tmp_path) < 8 * 2**20


def _disk_free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("mode", MODES)
def test_chroot_mount_and_new_namespaces_are_refused(mode, tmp_path):
    source = """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def chroot():
        os.chroot("/tmp")
    def unshare_user():
        assert libc.unshare(0x10000000) == 0, ctypes.get_errno()  # CLONE_NEWUSER
    def mount_tmpfs():
        assert libc.unshare(0x00020000) == 0, ctypes.get_errno()  # CLONE_NEWNS
        assert libc.mount(b"none", b"/mnt", b"tmpfs", 0, None) == 0, ctypes.get_errno()
    attempt("chroot", chroot)
    attempt("unshare user", unshare_user)
    attempt("mount", mount_tmpfs)
    """
    output = run(mode, source, tmp_path)
    done = [line for line in output.splitlines() if line.startswith("done:")]
    if mode == "plain":  # root on the host can (a plain user gets a user namespace at least)
        assert done, output
    else:
        assert not done, output


def test_benign_programs_still_pass(tmp_path):
    """The built-in code_functions problems with their reference solutions pass in the whole sandbox, and
    with a wrong body fail (the asserts ran)."""
    import json

    from lmforge.eval.bundle import build_bundle
    from lmforge.eval.sandbox import run_many

    build_bundle(tmp_path / "bundle", n=40)
    lines = (tmp_path / "bundle" / "code_functions.jsonl").read_text().splitlines()
    docs = [json.loads(line) for line in lines]
    assert len(docs) >= 20
    right = [d["prompt"] + d["canonical_solution"] + "\n" + d["test"] for d in docs]
    wrong = [d["prompt"] + "    return None\n\n" + d["test"] for d in docs]
    outs = run_many(right + wrong, timeout_s=5)
    assert all(o.passed for o in outs[: len(docs)]), [o for o in outs if not o.passed][:2]
    assert all(o.status == "failed" for o in outs[len(docs) :])


UNPRIVILEGED = """
import json, os, socket, sys
from lmforge.eval.sandbox import _run, check_isolation
check_isolation()
probe = '''
import json, os, socket
out = {"uid": os.getuid(), "cwd": os.getcwd()}
for name, fn in (
    ("write", lambda: open(%r + "/x", "w")),
    ("fork", os.fork),
    ("net", lambda: socket.create_connection(("127.0.0.1", %d), timeout=1)),
    ("root", lambda: os.mkdir("/x")),
):
    try:
        fn()
        out[name] = "done"
    except OSError as e:
        out[name] = e.errno
print(json.dumps(out))
''' % (sys.argv[1], int(sys.argv[2]))
out = _run(probe, 5.0, 256, 10000, os_layer=True, hook=False)
print(out.stdout or out.stderr)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user (the test runs as one)")
def test_an_unprivileged_user_gets_the_same_sandbox(host, tmp_path):
    """lmforge run by an ordinary user (not root): bwrap makes the user namespace itself. The sandbox
    modules run from a copy in a bare system Python as uid 65534 (nobody)."""
    import shutil

    src = Path(__file__).resolve().parents[2] / "src" / "lmforge"
    python, setpriv = shutil.which("python3", path="/usr/bin:/bin"), shutil.which("setpriv")
    if python is None or setpriv is None:
        pytest.skip("needs /usr/bin/python3 and setpriv (util-linux)")
    root = Path(tempfile.mkdtemp(prefix="lmforge-unprivileged-"))  # pytest's tmp_path is root's alone
    try:
        tree = root / "lmforge"
        shutil.copytree(src / "eval" / "sandbox", tree / "eval" / "sandbox")
        shutil.copy(src / "errors.py", tree / "errors.py")
        (tree / "__init__.py").write_text("")
        (tree / "eval" / "__init__.py").write_text("")
        for p in [root, *root.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        proc = subprocess.run(
            [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", UNPRIVILEGED,
             str(host.dir), str(host.port)],
            capture_output=True, text=True, timeout=60, cwd=root,
            env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "HOME": str(root)},
        )  # fmt: skip
    finally:
        shutil.rmtree(root)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["uid"] == 65534 and out["cwd"] == "/work"
    assert out["fork"] == errno.EPERM and out["root"] == errno.EROFS
    assert out["write"] == errno.ENOENT and out["net"] == errno.ECONNREFUSED
    assert not list(host.dir.glob("x")) and not host.accepted
