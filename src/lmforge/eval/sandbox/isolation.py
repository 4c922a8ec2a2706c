"""The operating-system layer of the sandbox: bubblewrap (`bwrap`, the sandbox behind Flatpak, a small
setuid-free C program that Debian, Ubuntu, Fedora and Arch package) starts each program in new user, pid,
network, mount, IPC, UTS and cgroup namespaces, as an unprivileged user, under a seccomp filter
(seccomp.py), with

- a file system of its own: the system's /usr (and /lib, /bin links) and the Python installation
  read-only (their site-packages hidden), a fresh /proc that shows only the sandbox's processes (no
  /proc/<parent>/environ), a minimal /dev, the program read-only at /sandbox/program.py, and two small
  tmpfs, /work (the cwd and HOME) and /tmp, as the only writable places: their size bounds what the
  program can write, and nothing it writes reaches the disk or outlives it;
- no network: a network namespace with only a loopback device of its own (the host's 127.0.0.1 is
  another machine from inside);
- no way to outlive the deadline: bwrap is pid 1 of the sandbox's pid namespace and dies with its parent
  (`--die-with-parent`); when it dies the kernel kills every process in the namespace, daemons in new
  sessions included. The harness SIGKILLs bwrap at the deadline.

Why bubblewrap: it is maintained (Flatpak's boundary), packaged everywhere, needs no daemon, no root and
no image, and starts in a few milliseconds. nsjail does the same with a larger build and no Debian
package; gVisor or a VM isolate more but cost a runtime per program.

Who the program runs as. Without root, bwrap maps the caller's uid to uid 65534 in a new user namespace
(the program holds no capability, cannot make another namespace, and RLIMIT_NPROC counts its processes
in that namespace only). As root, a user namespace that bwrap makes would map the sandbox to root outside
(kernel uid 0, which RLIMIT_NPROC does not bind), so lmforge makes the user namespace itself first, with
inner 0 -> root (for bwrap's set-up) and 65534 -> 65534 (nobody), hands it to bwrap (`--userns`), and the
prelude switches to 65534 before the program's first line: the program is kernel uid 65534 with no
capabilities.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field

from lmforge.errors import LmforgeError
from lmforge.eval.sandbox.seccomp import filter_program

NOBODY = 65534  # the sandbox's uid and gid (the kernel's overflow id; "nobody" / "nogroup")
WORK = "/work"  # the program's cwd and HOME inside the sandbox
PROGRAM = "/sandbox/program.py"
WORK_BYTES = 16 * 2**20  # the /work tmpfs: what the program may write in all
TMP_BYTES = 4 * 2**20  # the /tmp tmpfs

INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `sudo apt-get install bubblewrap`; Fedora: `sudo dnf install "
    "bubblewrap`; Arch: `sudo pacman -S bubblewrap`)"
)


class SandboxUnavailable(LmforgeError):
    """The operating-system sandbox cannot run on this machine (the message says why and what to do)."""


@dataclass
class Launch:
    """One sandboxed start: the argv to run and the descriptors it inherits (closed by `close()`)."""

    argv: list[str]
    fds: list[int] = field(default_factory=list)

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def python_executable() -> str:
    """The interpreter sandboxed programs run on: this Python's base installation (a venv's python is a
    link into it; -I -S keeps the venv's packages out anyway)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def launch(program_file: str, command: list[str]) -> Launch:
    """The bwrap command that runs `command` (the sandboxed python and its arguments) in the sandbox, with
    `program_file` (a host file) read-only at PROGRAM. Raises SandboxUnavailable without bwrap."""
    bwrap = bwrap_path()
    if bwrap is None:
        raise SandboxUnavailable(f"bubblewrap (`bwrap`) is not installed: {INSTALL_HINT}")
    out = Launch([bwrap])
    try:
        out.argv += [
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--hostname", "sandbox", "--cap-drop", "ALL",
            "--clearenv", "--setenv", "HOME", WORK, "--setenv", "TMPDIR", "/tmp", "--setenv", "PATH",
            "/usr/bin:/bin", "--setenv", "MALLOC_ARENA_MAX", "2",  # arenas eat RLIMIT_AS per thread
        ]  # fmt: skip
        if os.geteuid() == 0:
            out.fds.append(_nobody_user_namespace())
            # bwrap keeps these two (after the drop) for the prelude's switch to NOBODY, which clears them
            out.argv += ["--userns", str(out.fds[-1]), "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            out.argv += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--disable-userns"]
        out.argv += _mounts(program_file, command[0])
        program = filter_program()
        if program is not None:
            read, write = os.pipe()
            out.fds.append(read)
            try:
                os.write(write, program)  # a few hundred bytes: fits the pipe's buffer
            finally:
                os.close(write)
            out.argv += ["--seccomp", str(read)]
        out.argv += ["--chdir", WORK, "--", *command]
    except BaseException:
        out.close()
        raise
    return out


def layers() -> str:
    """What isolates a sandboxed program on this machine, in words (for reports)."""
    seccomp = "seccomp filter" if filter_program() is not None else "no seccomp filter (unknown architecture)"
    return f"bubblewrap: user/pid/net/mount/ipc namespaces, uid {NOBODY}, {seccomp}, rlimits, audit hook"


@functools.lru_cache(maxsize=1)
def _system_dirs() -> tuple[tuple[str, str], ...]:
    """(kind, path) of the top-level system dirs the interpreter and its libraries need: /usr bound,
    /bin, /lib, /lib64 ... bound or, on merged-/usr systems, links into /usr."""
    out = [("bind", "/usr")]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            out.append(("link", top))
        elif os.path.isdir(top):
            out.append(("bind", top))
    return tuple(out)


def _mounts(program_file: str, python: str) -> list[str]:
    args: list[str] = []
    bound = []
    for kind, path in _system_dirs():
        if kind == "link":
            args += ["--symlink", os.readlink(path), path]
        else:
            args += ["--ro-bind", path, path]
            bound.append(path)
    # the Python installation, where it lies outside them (pyenv, conda, /opt): its directories' parents
    # are made traversable (a parent such as /root may be 0700 on the host)
    prefix = os.path.realpath(sys.base_prefix)
    for root in {prefix, os.path.dirname(python)}:
        if any(root == b or root.startswith(b + "/") for b in bound):
            continue
        parent, parents = os.path.dirname(root), []
        while parent not in ("/", ""):
            parents.append(parent)
            parent = os.path.dirname(parent)
        for p in reversed(parents):
            args += ["--perms", "0755", "--dir", p]
        args += ["--ro-bind", root, root]
        bound.append(root)
    # the installation's third-party packages: not needed (-S) and not the program's business
    paths = sysconfig.get_paths(vars={"base": prefix, "platbase": prefix})
    for site in sorted({os.path.realpath(paths[key]) for key in ("purelib", "platlib")}):
        if os.path.isdir(site) and any(site.startswith(b + "/") for b in bound):
            args += ["--tmpfs", site]
    args += [
        "--proc", "/proc", "--dev", "/dev",
        "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp",
        "--perms", "0777", "--size", str(WORK_BYTES), "--tmpfs", WORK,
        "--perms", "0755", "--dir", os.path.dirname(PROGRAM), "--ro-bind", program_file, PROGRAM,
        "--remount-ro", "/",
    ]  # fmt: skip
    return args


def _nobody_user_namespace() -> int:
    """A new user namespace mapping 0 -> 0 and NOBODY -> NOBODY (root writes maps the kernel does not
    let bwrap write), as an open descriptor of /proc/<pid>/ns/user. A helper process makes it
    (`unshare --user`, util-linux) and exits once it is held."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxUnavailable(
            "running the sandbox as root needs util-linux's `unshare` to make its user namespace "
            "(Debian/Ubuntu: `apt-get install util-linux`)"
        )
    helper = subprocess.Popen(
        [unshare, "--user", "/bin/sh", "-c", "echo ready; read _"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
    )  # fmt: skip
    try:
        if helper.stdout.readline() != b"ready\n":  # the shell runs once the namespace exists
            raise SandboxUnavailable(
                "could not create a user namespace (`unshare --user`): "
                + helper.stderr.read().decode(errors="replace").strip()[:300]
            )
        mapping = f"0 0 1\n{NOBODY} {NOBODY} 1\n"
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{helper.pid}/{name}", "w") as f:
                f.write(mapping)
        return os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        helper.stdin.close()
        helper.wait()
        helper.stdout.close()
        helper.stderr.close()
