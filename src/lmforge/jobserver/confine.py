"""Path rules of the job server: where a submitted config may read and write.

A job's config comes from a client, so every path in it is untrusted. `Confiner.confine` forces run.dir to
<workspace>/jobs/<id>/run and resolves every other path key (config/paths.py classifies them: inputs the
run reads, outputs it writes) after symlinks. The config the job then runs holds those resolved absolute
paths, so what was checked is what is used.

What a user's job may read: the workspace (the data the operator put there) and the operator's
--allow-root dirs, but never the server's own files (server.db, server.lock), another user's job dir, the
jobs/ dir or the workspace itself as a whole (a walk of either would reach both), nor a dir that holds a
link to any of those. What it may write (outputs): its own jobs' dirs only; an output the run only reads
when it exists (prepared data in data.dir) may also name existing data it may read. A relative input is
looked for in the workspace, a relative output goes into the job's own dir. Names (job ids,
artifact names) are matched against tight patterns before they touch the file system.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from lmforge.config.paths import OUTPUT, PATH_KEYS, PathKey, is_service_url, map_paths
from lmforge.config.schema import Config
from lmforge.errors import LmforgeError
from lmforge.jobserver.store import DB_NAME, LOCK_NAME

JOBS_DIR = "jobs"
JOB_ID_RE = re.compile(r"^job-[0-9a-f]{16}$")
# An artifact is a plain file name or dir/name inside a job's run dir: no '..', no leading dot or slash.
ARTIFACT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}(/[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}){0,3}$")

SERVER_FILES = (DB_NAME, LOCK_NAME)  # DB_NAME also covers its -wal and -shm files
# A dir a job names is searched for links out of bounds (the data readers follow links); past this
# many entries the job is refused rather than the server busy for long.
MAX_SCAN_ENTRIES = 100_000


class ConfinementError(LmforgeError):
    """A path in a submitted config, or a name in a request, points where it may not."""

    def __init__(self, msg: str, key: str | None = None) -> None:
        super().__init__(msg)
        self.key = key


def check_job_id(job_id: str) -> str:
    if not JOB_ID_RE.match(job_id or ""):
        raise ConfinementError(f"{job_id!r} is not a job id (job-<16 hex digits>)", "id")
    return job_id


def check_artifact_name(name: str) -> str:
    if not ARTIFACT_RE.match(name or "") or ".." in name.split("/"):
        raise ConfinementError(f"{name!r} is not an artifact name (GET /v1/jobs/{{id}}/artifacts lists them)",
                               "name")
    return name


def within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def job_dir(workspace: Path, job_id: str) -> Path:
    return workspace / JOBS_DIR / check_job_id(job_id)


def resolve_inside(base: Path, name: str) -> Path:
    """`base / name` after symlinks, refused when it leaves `base` (a link in a run dir pointing out)."""
    real_base = Path(os.path.realpath(base))
    p = Path(os.path.realpath(base / name))
    if not within(p, real_base):
        raise ConfinementError(f"{name!r} leaves its job's directory", "name")
    return p


class Confiner:
    """The rules of one server: its workspace, the extra roots the operator allowed, and a way to tell
    whether a job id belongs to the requesting user (paths into own earlier jobs are fine)."""

    def __init__(self, workspace: str | Path, allow_roots: Sequence[str | Path] = ()) -> None:
        self.workspace = Path(os.path.realpath(workspace))
        self.roots = [self.workspace] + [Path(os.path.realpath(r)) for r in allow_roots]

    def check_path(self, key: str, value: str, own_job: Callable[[str], bool], this_job: str) -> str:
        """`value` with its path resolved (relative to the workspace, after symlinks) if the key's role
        allows it there, else ConfinementError. Built-in names pass as they are."""
        spec = PATH_KEYS[key]
        if not isinstance(value, str):
            return value
        if spec.services and is_service_url(value):
            raise ConfinementError(f"config key {key!r}: {value!r}: a job server's runs log to a file store "
                                   "only (file:<dir> or a dir inside one of your jobs)", key)
        split = spec.split(value)
        if split is None:
            return value
        prefix, path = split
        return prefix + self._check_fs_path(key, spec, path, own_job, this_job)

    def _check_fs_path(self, key: str, spec: PathKey, value: str, own_job: Callable[[str], bool],
                       this_job: str) -> str:
        if not value.strip():
            raise ConfinementError(f"config key {key!r}: an empty path names the job's working dir; give a "
                                   "file or dir (or leave the key out)", key)
        if "\x00" in value:
            raise ConfinementError(f"config key {key!r}: a path cannot hold a NUL byte", key)
        # An input is looked for where the data is (the workspace); an output the run makes goes where the
        # job works (its own dir, the launcher's working dir), as a relative path does under the CLI.
        base = job_dir(self.workspace, this_job) if spec.role == OUTPUT else self.workspace
        p = Path(os.path.realpath(base / os.path.expanduser(value)))
        why = self._unreadable(p, own_job, this_job)
        if why:
            raise ConfinementError(f"config key {key!r}: {value!r} resolves to {p}, {why}", key)
        try:
            if spec.role == OUTPUT and not self._own(p, own_job, this_job):
                if not (spec.reused and p.is_dir() and any(p.iterdir())):
                    also = " (or reads an existing prepared data dir)" if spec.reused else ""
                    raise ConfinementError(
                        f"config key {key!r}: {value!r} resolves to {p}, outside your jobs' dirs: a job "
                        f"writes only inside its own dir (jobs/{this_job}, the default) or one of your "
                        f"earlier jobs'{also}", key)
            if p.is_dir():
                self._scan_links(key, value, p, own_job, this_job)
        except OSError as e:  # a name too long, a loop of links: nothing a job could use either
            raise ConfinementError(f"config key {key!r}: {value[:200]!r} cannot be used: {e.strerror}", key) \
                from None
        return str(p)

    def _own(self, p: Path, own_job: Callable[[str], bool], this_job: str) -> bool:
        """True if `p` lies inside this job's dir or an earlier job of the same user."""
        jobs = self.workspace / JOBS_DIR
        if jobs not in p.parents:
            return False
        other = p.relative_to(jobs).parts[0]
        return other == this_job or bool(JOB_ID_RE.match(other) and own_job(other))

    def _unreadable(self, p: Path, own_job: Callable[[str], bool], this_job: str) -> str | None:
        """Why a job of this user may not read `p` (resolved), or None if it may."""
        if not any(within(p, r) for r in self.roots):
            allowed = ", ".join(str(r) for r in self.roots)
            return (f"outside the server's workspace and allowed roots ({allowed}); put the data there (or "
                    "ask the operator for an --allow-root)")
        if within(self.workspace, p):
            return ("the server's workspace as a whole (or a dir above it), which holds every user's jobs "
                    "and the server's database; name the files or dirs of your data inside it")
        if within(p, self.workspace):
            rel = p.relative_to(self.workspace).parts
            if rel[0].startswith(SERVER_FILES):
                return "one of the server's own files"
            if rel[0] == JOBS_DIR:
                if len(rel) == 1:
                    return "the dir of every user's jobs; name one of your own jobs (jobs/<id>)"
                if not self._own(p, own_job, this_job):
                    return "inside another job's directory that is not yours"
        return None

    def _scan_links(self, key: str, value: str, top: Path, own_job: Callable[[str], bool],
                    this_job: str) -> None:
        """Refuse a dir that holds a link to a place the user may not read: the data readers follow links,
        so a link inside a readable dir would read what the dir's own path may not."""
        seen, todo, count = set(), [top], 0
        while todo:
            d = todo.pop()
            try:
                st = os.stat(d)
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                entries = list(os.scandir(d))
            except OSError:
                continue  # unreadable here is unreadable for the job too: its readers report it
            count += len(entries)
            if count > MAX_SCAN_ENTRIES:
                raise ConfinementError(f"config key {key!r}: {value!r} holds more than {MAX_SCAN_ENTRIES:,} "
                                       "files and dirs to check for links; name its subdirs or files instead",
                                       key)
            for e in entries:
                try:
                    link, is_dir = e.is_symlink(), e.is_dir()
                except OSError:
                    continue
                if link:
                    real = Path(os.path.realpath(e.path))
                    why = self._unreadable(real, own_job, this_job)
                    if why:
                        rel = Path(e.path).relative_to(top)
                        raise ConfinementError(f"config key {key!r}: {value!r} holds a link {rel} to {real}, "
                                               f"{why}", key)
                    if is_dir:
                        todo.append(real)
                elif is_dir:
                    todo.append(Path(e.path))

    def confine(self, cfg: Config, job_id: str, own_job: Callable[[str], bool]) -> Config:
        """`cfg` with run.dir under the job's dir and every other path key checked and resolved."""
        data = cfg.model_dump(mode="python")
        data["run"]["dir"] = str(job_dir(self.workspace, job_id) / "run")
        data["run"]["overwrite"] = False
        data = map_paths(data, lambda key, spec, value: value if key == "run.dir" else
                         self.check_path(key, value, own_job, job_id))
        return Config.model_validate(data)
