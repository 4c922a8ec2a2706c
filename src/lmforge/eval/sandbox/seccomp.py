"""The seccomp filter of the sandbox: a classic-BPF program (the bytes bubblewrap's `--seccomp FD` loads)
that the kernel runs on every system call of a sandboxed program.

It allows every call but these, which fail with EPERM:
- new processes: fork, vfork and clone without CLONE_THREAD (threads stay possible; RLIMIT_NPROC counts
  them), and clone3 (ENOSYS, so that libc falls back to clone, whose flags a filter can read: clone3 passes
  them in memory);
- the kernel's ways around the namespaces: unshare, setns, mount and the new mount API, pivot_root, chroot,
  open_by_handle_at / name_to_handle_at (the classic container escape), ptrace and process_vm_*, kcmp,
  pidfd_getfd, personality;
- kernel surfaces a test program never needs and that carry most kernel CVEs: bpf, perf_event_open,
  userfaultfd, io_uring, the key ring, modules, kexec, swap, reboot, clock and time setting, syslog, quotas;
- device nodes and FIFOs (mknod, mknodat).
A call of another architecture's ABI (x32 on x86_64, or the 32-bit one) kills the process: the numbers
above mean other calls there.

The namespaces, not this filter, are the boundary; the filter shrinks what the program can reach of the
kernel from inside them. Tables for x86_64 and aarch64 (the numbers from the kernel's unistd headers);
`filter_program()` is None on other machines, where the sandbox runs without this layer and says so.
"""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (little-endian hosts)
_NR, _ARCH, _ARG0_LOW = 0, 4, 16

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000  # x86_64 calls with this bit set are the x32 ABI
_CLONE_THREAD = 0x00010000

_DENIED = (
    "fork", "vfork", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "personality",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "init_module", "finit_module", "delete_module", "kexec_load",
    "kexec_file_load", "acct", "swapon", "swapoff", "reboot", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "syslog", "quotactl", "quotactl_fd", "lookup_dcookie", "vhangup",
    "fanotify_init", "mknod", "mknodat", "ioperm", "iopl", "uselib", "nfsservctl", "_sysctl",
)  # fmt: skip

# System call numbers: arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h
_TABLES: dict[str, dict[str, int]] = {
    "x86_64": {
        "fork": 57, "vfork": 58, "clone": 56, "clone3": 435, "ptrace": 101, "process_vm_readv": 310,
        "process_vm_writev": 311, "kcmp": 312, "pidfd_getfd": 438, "personality": 135, "unshare": 272,
        "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "fsopen": 430,
        "fsconfig": 431, "fsmount": 432, "fspick": 433, "move_mount": 429, "open_tree": 428,
        "mount_setattr": 442, "open_by_handle_at": 304, "name_to_handle_at": 303, "bpf": 321,
        "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "keyctl": 250, "add_key": 248, "request_key": 249, "init_module": 175,
        "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320, "acct": 163,
        "swapon": 167, "swapoff": 168, "reboot": 169, "settimeofday": 164, "clock_settime": 227,
        "clock_adjtime": 305, "adjtimex": 159, "syslog": 103, "quotactl": 179, "quotactl_fd": 443,
        "lookup_dcookie": 212, "vhangup": 153, "fanotify_init": 300, "mknod": 133, "mknodat": 259,
        "ioperm": 173, "iopl": 172, "uselib": 134, "nfsservctl": 180, "_sysctl": 156,
    },
    "aarch64": {  # no fork, vfork, mknod, ioperm, iopl, uselib or _sysctl calls on this architecture
        "clone": 220, "clone3": 435, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
        "kcmp": 272, "pidfd_getfd": 438, "personality": 92, "unshare": 97, "setns": 268, "mount": 40,
        "umount2": 39, "pivot_root": 41, "chroot": 51, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "move_mount": 429, "open_tree": 428, "mount_setattr": 442, "open_by_handle_at": 265,
        "name_to_handle_at": 264, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 219, "add_key": 217,
        "request_key": 218, "init_module": 105, "finit_module": 273, "delete_module": 106, "kexec_load": 104,
        "kexec_file_load": 294, "acct": 89, "swapon": 224, "swapoff": 225, "reboot": 142,
        "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171, "syslog": 116,
        "quotactl": 60, "quotactl_fd": 443, "lookup_dcookie": 18, "vhangup": 58, "fanotify_init": 262,
        "mknodat": 33, "nfsservctl": 42,
    },
}  # fmt: skip

# classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h)
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000


def filter_program(machine: str | None = None) -> bytes | None:
    """The filter for this machine's architecture as `struct sock_filter` records, or None where lmforge
    has no table (then the sandbox runs without a seccomp layer)."""
    machine = machine or platform.machine()
    if machine not in _TABLES:
        return None
    table = _TABLES[machine]
    denied = [table[name] for name in _DENIED if name in table]
    # Jumps are relative and forward only, so the verdicts sit after the checks; a check's target is the
    # distance from the instruction after it to the verdict's index (resolved below from these labels).
    code: list[tuple[int, object, object, int]] = [
        (_LD_ABS, 0, 0, _ARCH),
        (_JEQ, 0, "kill", _AUDIT_ARCH[machine]),
        (_LD_ABS, 0, 0, _NR),
    ]
    if machine == "x86_64":
        code.append((_JGE, "kill", 0, _X32_BIT))
    code += [(_JEQ, "eperm", 0, nr) for nr in denied]
    code += [
        (_JEQ, "enosys", 0, table["clone3"]),
        (_JEQ, "clone", 0, table["clone"]),
        (_RET, 0, 0, _ALLOW),
    ]
    labels = {"clone": len(code)}
    code += [(_LD_ABS, 0, 0, _ARG0_LOW), (_JSET, "allow", "eperm", _CLONE_THREAD)]
    for name, verdict in (
        ("allow", _ALLOW),
        ("eperm", _ERRNO | errno.EPERM),
        ("enosys", _ERRNO | errno.ENOSYS),
        ("kill", _KILL_PROCESS),
    ):
        labels[name] = len(code)
        code.append((_RET, 0, 0, verdict))
    out = bytearray()
    for i, (op, jt, jf, k) in enumerate(code):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        assert 0 <= jt < 256 and 0 <= jf < 256, "a BPF jump is too long"
        out += struct.pack("<HBBI", op, jt, jf, k)
    return bytes(out)
