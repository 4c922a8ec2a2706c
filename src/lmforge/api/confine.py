"""Path rules of the job server: where a submitted config may read and write.

A job's config comes from a client, so every path in it is untrusted. `confine_config` forces run.dir
to <workspace>/jobs/<id>/run and resolves every other path key (after symlinks, relative to the
workspace) to a place inside the workspace or an operator's --allow-root; the config the job then runs
holds those resolved absolute paths, so what was checked is what is used. Inside the workspace,
another user's job dir and the server's own database are out of bounds. Names (job ids, artifact
names) are matched against tight patterns before they touch the file system.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmforge.api.store import DB_NAME
from lmforge.config.schema import Config
from lmforge.errors import LmforgeError

JOBS_DIR = "jobs"
JOB_ID_RE = re.compile(r"^job-[0-9a-f]{16}$")
# An artifact is a plain file name or dir/name inside a job's run dir: no '..', no leading dot or slash.
ARTIFACT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}(/[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}){0,3}$")

# Every config key that names a file or dir (tests/hostile/test_jobs_security.py checks that each str
# key of the schema is in one of these two tables, so a new path key cannot slip past unconfined).
PATH_KEYS: tuple[str, ...] = (
    "data.sources", "data.val_sources", "data.dir", "data.tokenizer.path", "model.init_from",
    "train.eval_tasks", "sft.data", "sft.val_data", "sft.template", "preference.data", "preference.val_data",
    "rl.data", "rl.val_data", "rl.reward_model", "distill.teacher", "distill.topk_cache",
    "finetune.init_adapter", "curate.inputs", "curate.output_dir", "logging.wandb.dir",
    "logging.mlflow.tracking_uri",  # a file: URI or a path; network URIs are refused (see check_path)
)
NOT_PATH_KEYS: tuple[str, ...] = (
    "run.name", "run.dir", "data.text_key", "model.preset", "model.quant.targets", "finetune.targets",
    "generate.prompt", "curate.text_key", "curate.id_key", "logging.mlflow.experiment",
    "logging.mlflow.run_name", "logging.wandb.project", "logging.wandb.entity", "logging.wandb.run_name",
)
# Values of path keys that are names, not paths.
_BUILTINS = {"sft.template": ("auto", "chatml")}
_BUILTIN_PREFIX = "builtin:"


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
        """`value` resolved (relative to the workspace, after symlinks) if allowed, else ConfinementError."""
        if not isinstance(value, str) or not value:
            return value
        if key == "data.sources" or key == "data.val_sources" or key == "train.eval_tasks":
            if value.startswith(_BUILTIN_PREFIX):
                return value
        if value in _BUILTINS.get(key, ()):
            return value
        if key == "logging.mlflow.tracking_uri":
            if "://" in value and not value.startswith("file://"):
                raise ConfinementError(f"config key {key!r}: {value!r}: a job server's runs log to a file "
                                       "store only (file:/path or a path inside the workspace)", key)
            path = value.removeprefix("file://").removeprefix("file:")
            return "file:" + self._check_fs_path(key, path, own_job, this_job)
        return self._check_fs_path(key, value, own_job, this_job)

    def _check_fs_path(self, key: str, value: str, own_job: Callable[[str], bool], this_job: str) -> str:
        if "\x00" in value:
            raise ConfinementError(f"config key {key!r}: a path cannot hold a NUL byte", key)
        p = Path(os.path.realpath(self.workspace / os.path.expanduser(value)))
        if not any(within(p, r) for r in self.roots):
            allowed = ", ".join(str(r) for r in self.roots)
            raise ConfinementError(f"config key {key!r}: {value!r} resolves to {p}, outside the server's "
                                   f"workspace and allowed roots ({allowed}); put the data there (or ask the "
                                   "operator for an --allow-root)", key)
        if within(p, self.workspace):
            rel = p.relative_to(self.workspace).parts
            if rel and rel[0].startswith(DB_NAME):
                raise ConfinementError(f"config key {key!r}: {value!r} is the server's database", key)
            if rel and rel[0] == JOBS_DIR:
                other = rel[1] if len(rel) > 1 else ""
                if other != this_job and not (JOB_ID_RE.match(other) and own_job(other)):
                    raise ConfinementError(f"config key {key!r}: {value!r} is inside another job's "
                                           "directory that is not yours", key)
        return str(p)

    def confine(self, cfg: Config, job_id: str, own_job: Callable[[str], bool]) -> Config:
        """`cfg` with run.dir under the job's dir and every path key checked and resolved."""
        data = cfg.model_dump(mode="python")
        data["run"]["dir"] = str(job_dir(self.workspace, job_id) / "run")
        data["run"]["overwrite"] = False
        for key in PATH_KEYS:
            node: Any = data
            *parents, leaf = key.split(".")
            for k in parents:
                node = node.get(k) if isinstance(node, dict) else None
            if not isinstance(node, dict) or node.get(leaf) is None:
                continue
            v = node[leaf]
            if isinstance(v, list):
                node[leaf] = [self.check_path(key, x, own_job, job_id) for x in v]
            else:
                node[leaf] = self.check_path(key, v, own_job, job_id)
        return Config.model_validate(data)
