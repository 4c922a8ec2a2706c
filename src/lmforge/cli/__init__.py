"""`lmforge <verb>`: parse with the verb table (lmforge.cli.verbs), run the verb's handler, and print user
errors as one line (the one place they are printed)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator

from lmforge.cli.verbs import BY_NAME, RENAMED, VERBS, build_parser, mode_parser, table
from lmforge.errors import ConfigError, LmforgeDeprecationWarning, LmforgeError

__all__ = ["VERBS", "build_parser", "main", "table"]


@contextlib.contextmanager
def _plain_warnings(verb: str, rank: int) -> Iterator[None]:
    """lmforge's own warnings (deprecated config keys) as one plain line each, from rank 0."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, LmforgeDeprecationWarning):
            return shown(message, category, filename, lineno, file, line)
        if rank == 0:
            print(f"lmforge {verb}: warning: {message}", file=sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _renamed(argv: list[str]) -> list[str]:
    """`lmforge OLD ...` of a renamed verb runs as `lmforge NEW ...`, saying so in one line (from rank 0). The
    arguments are not echoed: they may hold a key (--publish-key)."""
    new = RENAMED.get(argv[0]) if argv else None
    if new is None:
        return argv
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"lmforge {argv[0]}: warning: `lmforge {argv[0]}` is deprecated and goes after this release; "
              f"it is now `lmforge {new}` (the same arguments)", file=sys.stderr)
    return [new, *argv[1:]]


def _parse(argv: list[str]) -> tuple[argparse.Namespace, Callable[[argparse.Namespace], int]]:
    """The parsed arguments and the handler: `lmforge VERB MODE ...` goes to the mode's own parser."""
    verb = BY_NAME.get(argv[0]) if argv else None
    mode = next((m for m in verb.modes if m.name == argv[1]), None) if verb and len(argv) > 1 else None
    if mode is not None:
        args = mode_parser(verb, mode).parse_args(argv[2:])
        args.verb = verb.name
        return args, mode.run
    args = build_parser().parse_args(argv)
    args.argv = argv  # what was typed (a deprecated form's warning names its new form)
    return args, BY_NAME[args.verb].run


def main(argv: list[str] | None = None) -> int:
    # When a time budget starts: the process's start for a command line (argv None), this call for a caller
    # in Python (a test, a notebook) whose process began long before.
    started = None if argv is None else time.perf_counter()
    argv = _renamed(list(sys.argv[1:] if argv is None else argv))
    try:
        args, handler = _parse(argv)
    except SystemExit as e:  # argparse printed a usage error (a flag out of range, ...): exit 2 as any
        if e.code == 2:  # other user error, returned rather than raised so that callers see the status
            return 2
        raise  # --help and --version exit 0 as argparse does
    args.started = started
    rank = int(os.environ.get("RANK", "0"))
    try:
        with _plain_warnings(args.verb, rank):
            return handler(args)
    except LmforgeError as e:
        code = getattr(e, "exit_code", 2)
        # Under torchrun a config error is raised identically on every rank: rank 0 says it once.
        if rank == 0 or not isinstance(e, ConfigError):
            where = f"[rank {rank}] " if rank else ""
            print(f"{where}lmforge {args.verb}: error: {e}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(f"lmforge {args.verb}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # the file system said no (read-only, permissions, full disk): not a bug
        where = f" {e.filename}" if e.filename else ""
        print(f"lmforge {args.verb}: error: cannot use{where}: {e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
