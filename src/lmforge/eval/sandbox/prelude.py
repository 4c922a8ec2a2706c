"""The sandbox's in-interpreter layer: the code that runs in the sandboxed python before the program
(`python -I -S -c PRELUDE ...`). It switches to the unprivileged user where the OS layer asks for it,
sets resource limits, installs the audit hook (the second layer: it turns what the OS layer would refuse
anyway into a clear "forbidden" status, and is the only layer under --unsafe-code-exec), runs the program
as `__main__` and ends the process with an exit code that says how it ended.
"""

from __future__ import annotations

EXIT_FAILED, EXIT_ERROR, EXIT_MEMORY, EXIT_FORBIDDEN = 201, 202, 203, 204  # any other code is an "error"
MARKER = "[lmforge-sandbox] "  # the line on stderr that carries the detail

# Runs in the child as `python -I -S -c PRELUDE dirs program memory cpu fsize nofile nproc drop hook`,
# `dirs` the directories the program may write in, joined by ':'.
# Everything the audit hook uses is bound as a default argument (immutable values and builtins captured
# before the program runs): no globals, no closures, nothing the program can monkeypatch.
_SOURCE = r'''
import sys, posix


def _lmforge_limits(memory, cpu, fsize, nofile, nproc):
    import resource

    limits = [
        (resource.RLIMIT_AS, memory, memory),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_NOFILE, nofile, nofile),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if nproc:  # only in a user namespace of its own, where the count is the sandbox's processes alone
        limits.append((resource.RLIMIT_NPROC, nproc, nproc))
    for res, soft, hard in limits:
        cap = resource.getrlimit(res)[1]
        if cap != resource.RLIM_INFINITY:
            soft, hard = min(soft, cap), min(hard, cap)
        resource.setrlimit(res, (soft, hard))


def _lmforge_hook(dirs):
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

    def inside(path, _type=type, _str=str, _roots=dirs, _prefixes=tuple(d + "/" for d in dirs)):
        return _type(path) is _str and (path in _roots or _str.startswith(path, _prefixes))

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
                # by its first or its last dotted part: an extension loaded again under another
                # dotted name ("x._posixsubprocess") is the same code
                if _type(name) is _str and (
                    _str.partition(name, ".")[0] in _imports or _str.rpartition(name, ".")[2] in _imports
                ):
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
    dirs, program_path = tuple(sys.argv[1].split(":")), sys.argv[2]
    memory, cpu, fsize, nofile, nproc, drop, hook = (int(arg) for arg in sys.argv[3:10])
    if drop and posix.getuid() == 0:
        # root's own user namespace (isolation.py): become `drop` before anything else runs; a uid
        # change from 0 clears every capability
        posix.setgroups([])
        posix.setgid(drop)
        posix.setuid(drop)
        if posix.getresuid() != (drop,) * 3 or posix.getresgid() != (drop,) * 3 or posix.getgroups():
            _write(2, (MARKER + "the sandbox could not switch to an unprivileged user\n").encode())
            _exit(EXIT_ERROR)
    _lmforge_limits(memory, cpu, fsize, nofile, nproc)
    with open(program_path, encoding="utf-8") as f:
        source = f.read()
    sys.argv[:] = ["<program>"]
    if hook:
        # fork_exec forks and execs without an audit event: swap it before anything can take a
        # reference (subprocess and multiprocessing then get the stand-in); re-creating the module is
        # then blocked
        import _posixsubprocess

        def fork_exec(*args, _audit=sys.audit):
            _audit("_posixsubprocess.fork_exec")
            raise OSError("no new processes")

        _posixsubprocess.fork_exec = fork_exec
        del fork_exec, _posixsubprocess
        sys.addaudithook(_lmforge_hook(dirs))
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
PRELUDE = (
    f"EXIT_FAILED, EXIT_ERROR, EXIT_MEMORY, EXIT_FORBIDDEN = "
    f"{EXIT_FAILED}, {EXIT_ERROR}, {EXIT_MEMORY}, {EXIT_FORBIDDEN}\nMARKER = {MARKER!r}\n" + _SOURCE
)
# compiled under a file name of its own, by which the hook knows the sandbox's functions
PRELUDE = f"exec(compile({PRELUDE!r}, '<lmforge-sandbox>', 'exec'))"


def command(
    python: str, dirs: list[str], program: str, limits: list[int], *, drop: int, hook: bool
) -> list[str]:
    """argv of the sandboxed interpreter: `dirs` where the program may write (for the hook), `limits` =
    [address space bytes, CPU s, file size bytes, open files, processes (0: not set)]; `drop`: the uid/gid
    to become when started as root (0: none)."""
    flags = [str(drop), str(int(hook))]
    return [python, "-I", "-S", "-c", PRELUDE, ":".join(dirs), program, *map(str, limits), *flags]
