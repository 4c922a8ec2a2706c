"""Worker processes that render untrusted chat templates (lmforge.data.template_sandbox run as a script),
and the pool that lends them out.

A worker is `python -I template_sandbox.py` in its own session: stdin and stdout are its pipes, stderr
goes nowhere (a template's failure is reported by its answer, never by a traceback on the user's
terminal). Each render of a request has `seconds` of wall clock from the moment the previous answer (or
the request, or the worker's word that a render finished) came, and each job JOB_SECONDS in all; a job
that outlives either, a worker that exits or one that ran out of memory is killed with SIGKILL and
replaced by a fresh one on the next request, and the caller gets an answer saying so.
Requests carry whole batches (SFT preparation sends dozens of conversations per round trip) and answers
come back one per job, so the job that overran is the one named.

`pool()` is the process's pool: one worker unless raised (`lmforge serve` keeps a few, so that one
refused render does not hold up other requests); workers start when first needed.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from lmforge.data import template_sandbox

WORKER = Path(template_sandbox.__file__)
START_SECONDS = 60.0  # a Python start on a loaded machine; not counted against any render
JOB_SECONDS = 60.0  # one conversation in all: a long one renders many prefixes, each within its deadline


class _Worker:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.buf = bytearray()

    def run(self, source: str, specials: dict[str, str], jobs: list[dict], seconds: float) -> list[dict]:
        """The answers to `jobs`, in order; the last is {"kind": "timeout" | "died"} when the worker had
        to be stopped there (the jobs after it are not run)."""
        line = json.dumps({"source": source, "specials": specials, "seconds": seconds, "jobs": jobs},
                          ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n"
        for attempt in (0, 1):
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            try:
                view = memoryview(line)
                while view:  # a raw pipe write may take only part of a large request
                    view = view[self.proc.stdin.write(view):]
                break
            except (BrokenPipeError, OSError):  # it died between requests (killed from outside): once more
                self.stop()
                if attempt:
                    raise
        answers: list[dict] = []
        for _ in jobs:
            answer = self._answer(seconds)
            answers.append(answer)
            if answer.get("kind") in ("timeout", "died", "memory"):
                code = self.stop()
                if answer["kind"] == "died" and not answer["error"]:
                    answer["error"] = f"exit status {code}"
                break
        return answers

    def _answer(self, seconds: float) -> dict:
        """The next job's answer: each render within `seconds` of the last one (a PROGRESS line says one
        finished), the whole job within JOB_SECONDS."""
        now = time.monotonic()
        cap = now + JOB_SECONDS
        deadline = now + seconds
        while True:
            try:
                raw = self._read_line(min(deadline, cap))
            except TimeoutError:
                return {"kind": "timeout", "error": "job" if deadline > cap else ""}
            except EOFError:
                return {"kind": "died", "error": ""}
            if raw != template_sandbox.PROGRESS:
                break
            deadline = time.monotonic() + seconds
        try:
            answer = json.loads(raw.decode("utf-8", "surrogatepass"))
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or ("error" not in answer and "text" not in answer):
            return {"kind": "died", "error": f"it answered {raw[:80]!r}"}
        return answer

    def _start(self) -> None:
        self.stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, bufsize=0, start_new_session=True, close_fds=True,
        )
        try:
            ready = self._read_line(time.monotonic() + START_SECONDS)
        except (TimeoutError, EOFError):
            code = self.stop()
            raise RuntimeError(f"the chat template worker did not start ({sys.executable} -I {WORKER}: "
                               f"exit status {code})") from None
        if ready != b'"ready"':
            self.stop()
            raise RuntimeError(f"the chat template worker answered {ready[:80]!r} instead of ready")

    def _read_line(self, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        seen = 0
        while (end := self.buf.find(b"\n", seen)) < 0:
            seen = len(self.buf)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            self.buf += chunk
        line = bytes(self.buf[:end])
        del self.buf[: end + 1]
        return line

    def stop(self) -> int | None:
        """Kill the worker (if any); its exit status."""
        proc, self.proc = self.proc, None
        self.buf.clear()
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        return proc.wait()


class Pool:
    """Up to `size` workers, lent one at a time (`with pool.worker() as w`)."""

    def __init__(self, size: int = 1) -> None:
        self.size = size
        self._idle: list[_Worker] = []
        self._count = 0
        self._cv = threading.Condition()

    def resize(self, size: int) -> None:
        with self._cv:
            self.size = max(size, 1)
            self._cv.notify_all()

    @contextmanager
    def worker(self):
        with self._cv:
            while not self._idle and self._count >= self.size:
                self._cv.wait()
            if self._idle:
                w = self._idle.pop()
            else:
                w, self._count = _Worker(), self._count + 1
        try:
            yield w
        finally:
            with self._cv:
                self._idle.append(w)
                self._cv.notify()

    def close(self) -> None:
        """Stop the idle workers' processes (each starts again when next needed)."""
        with self._cv:
            for w in self._idle:
                w.stop()


_POOL = Pool(1)
atexit.register(_POOL.close)


def pool() -> Pool:
    return _POOL
