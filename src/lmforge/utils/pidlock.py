"""An exclusive lock held by one process for its life: `fcntl.flock` on a file that names its holder.

The kernel drops the lock when the holder exits, however it exits (kill -9 included), so there are no
stale locks; the file itself only tells who holds it. A run dir (checkpoint/run_dir.py) and a job
server's workspace (jobserver/server.py) are locked this way.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from lmforge.errors import LmforgeError


def holder_line() -> str:
    """Who this process is, as a lock file tells it: pid, host and since when."""
    return f"pid {os.getpid()} on {socket.gethostname()} (since {time.strftime('%Y-%m-%d %H:%M:%S')})"


class PidLock:
    """The lock on `path` while this object holds it; `created` tells whether acquiring made the file."""

    def __init__(self, path: Path, fd: int | None, created: bool = False) -> None:
        self.path, self._fd, self.created = path, fd, created

    @classmethod
    def acquire(cls, path: Path, busy: Callable[[str], LmforgeError]) -> PidLock:
        """Lock `path` (made if missing) or raise `busy(holder)`, holder being the line its file holds."""
        try:
            import fcntl
        except ImportError:  # no flock (Windows): unlocked
            return cls(path, None)
        while True:
            created = not path.exists()
            # os.open's descriptors are not inherited: a job the server starts later does not hold its lock.
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
                os.close(fd)
                raise busy(holder) from None
            # A holder that gave up removes the file before it unlocks (`release(remove=True)`): a lock taken
            # on that old file would be a second holder beside whoever makes the new one, so take it again.
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder_line() + "\n").encode(), 0)
        return cls(path, fd, created)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, remove: bool = False) -> None:
        """Unlock; with `remove`, delete the lock file first (nothing of a refused command remains)."""
        if self._fd is None:
            return
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        else:
            os.ftruncate(self._fd, 0)  # a free lock names no holder
        os.close(self._fd)  # closing the descriptor releases the flock
        self._fd = None

    def __del__(self) -> None:
        self.release()
