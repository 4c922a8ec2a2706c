"""Atomic file writes: a crash or a full disk never leaves a partial file where a good one stood."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from lmforge.errors import LmforgeError


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside `path` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def disk_error(e: OSError, what: str) -> BaseException:
    """A full disk or quota error becomes a user error; any other OSError is returned as it is."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return LmforgeError(f"no space left on device while writing {what}; free some space and retry "
                            "(earlier files were left intact)")
    return e


def check_replaceable(path: str | os.PathLike) -> Path:
    """`path`, if writing a file there replaces nothing but a regular file: a rename over a device, a
    pipe or a directory (e.g. -o /dev/null as root) would swap that out of the file system."""
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file (a device, pipe or socket)"
        raise LmforgeError(f"{path} exists and is {kind}; refusing to replace it: give the path of a new or "
                           "regular file")
    if path.parent.exists() and not path.parent.is_dir():
        raise LmforgeError(f"{path.parent} is not a directory; give a path inside a directory")
    return path


def check_new_file(path: str | os.PathLike, overwrite: bool, flag: str = "--overwrite") -> Path:
    """`path`, if a file may be written there: a new path, or (with `overwrite`) a regular file to replace.
    Called before any work, so that a refusal costs nothing; the write itself then goes beside the file
    and is renamed over it (atomic_write_*), so a failure leaves the old file whole."""
    path = check_replaceable(path)
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise LmforgeError(f"{path} already exists; refusing to replace it: give {flag} to replace it, or "
                           "another path")
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        _unlink(tmp)
        raise disk_error(e, str(path)) from None
    except BaseException:
        _unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json_object(file: Path, what: str) -> dict[str, Any]:
    """The JSON object in `file` (`what` names it in errors: "a model config"); LmforgeError when the
    file is not valid JSON or holds something else."""
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LmforgeError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise LmforgeError(f"{file} holds a JSON {type(obj).__name__}; {what} is a JSON object")
    return obj


def _unlink(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass
