"""Experiment trackers: MLflow and Weights & Biases, beside metrics.jsonl and TensorBoard.

Each configured tracker (logging.mlflow / logging.wandb) gets, on the main rank only:
  - the resolved config: MLflow params (dotted keys, e.g. `optim.lr`), the W&B run config;
  - every metrics record at its step: every finite number under its own key (an event's fields as
    `event/<event>/<field>`, so that they never collide with the train loss of the same step; MLflow
    names use `.` for `/`: `grad_norm.decay`, see `mlflow_key`);
  - at the end: metrics.jsonl, curves.png and config.yaml as artifacts (MLflow artifacts, files of the
    W&B run) and the final checkpoint's path (MLflow tag / W&B summary `final_checkpoint`).

A resumed run continues the same tracker run: its id is kept in <run.dir>/trackers.json with, per
metric, the last step the tracker holds. The steps a resume redoes (those between the checkpoint and
the kill) are not logged twice: a deterministic resume gives them the same values, and a tracker's
history only grows (W&B refuses steps below its current one), so the tracker keeps the first copy.
After a loss-spike rollback the tracker keeps the discarded steps' values too; the rollback event
marks them and metrics.jsonl holds the redone ones.

The packages are optional extras, imported only when a tracker is enabled.
"""

from __future__ import annotations

import abc
import contextlib
import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmforge.config.schema import Config, MlflowConfig, WandbConfig
from lmforge.errors import LmforgeError
from lmforge.utils.io import check_replaceable

STATE_FILE = "trackers.json"
ARTIFACTS = ("metrics.jsonl", "curves.png", "config.yaml")
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
# MLflow's limits (mlflow.utils.validation): a longer param value is refused, a batch holds at most
# 100 params / 1000 metrics. A config value past the limit is cut; config.yaml has it whole.
_MLFLOW_PARAM_CHARS, _MLFLOW_PARAMS_PER_BATCH, _MLFLOW_METRICS_PER_BATCH = 6000, 100, 1000


def flatten_config(cfg: Config) -> dict[str, str]:
    """The config as MLflow params: dotted keys, strings as they are, every other value as JSON."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node if isinstance(node, str) else json.dumps(node)

    walk(cfg.model_dump(mode="json"), "")
    return out


def record_items(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of one metrics record, keyed as the trackers log them (see the module docstring)."""
    prefix = f"event/{record['event']}/" if "event" in record else ""
    return {
        prefix + k: float(v)
        for k, v in record.items()
        if k not in ("step", "event") and isinstance(v, (int, float)) and not isinstance(v, bool)
        and math.isfinite(v)
    }


def _missing(extra: str, package: str, key: str) -> LmforgeError:
    return LmforgeError(f"{key}=true but the {package} package is not installed; "
                        f"pip install 'lmforge[{extra}]' or set {key}=false")


def check_trackers(cfg: Config) -> None:
    """Refuse, before a run dir is touched, a tracker whose package is missing."""
    lc = cfg.logging
    if lc.mlflow.enabled:
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise _missing("mlflow", "mlflow (or mlflow-skinny)", "logging.mlflow.enabled") from None
    if lc.wandb.enabled:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise _missing("wandb", "wandb", "logging.wandb.enabled") from None


def _read_state(run_dir: Path) -> dict[str, dict[str, Any]]:
    """trackers.json of an earlier session; a damaged or foreign file counts as none (the run then
    starts new tracker runs; the file is rewritten, nothing else is touched)."""
    try:
        state = json.loads((run_dir / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(state, dict):
        return {}
    out = {}
    for name, entry in state.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("run_id"), str)
                and _RUN_ID.fullmatch(entry["run_id"]) and isinstance(entry.get("logged", {}), dict)):
            continue
        logged = {k: int(v) for k, v in entry.get("logged", {}).items()
                  if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)}
        out[name] = {**entry, "logged": logged}
    return out


class Tracker(abc.ABC):
    """One tracker run: `log` a metrics record, `finish` with the artifacts. `logged` maps each metric
    to the last step the tracker holds (carried across a resume, see the module docstring)."""

    name = ""

    def __init__(self, identity: dict[str, Any], logged: dict[str, int]) -> None:
        self.identity, self.logged, self.run_id = identity, logged, ""

    def fresh(self, step: int, items: dict[str, float]) -> dict[str, float]:
        """The items the tracker does not hold yet at `step`."""
        return {k: v for k, v in items.items() if step > self.logged.get(k, -1)}

    def state(self) -> dict[str, Any]:
        return {**self.identity, "run_id": self.run_id, "logged": self.logged}

    @abc.abstractmethod
    def log(self, step: int, items: dict[str, float]) -> None:
        """Record `items` (new to the tracker) at `step`."""

    @abc.abstractmethod
    def finish(self, artifacts: list[Path], checkpoint: Path | None, ok: bool) -> None:
        """Upload the final artifacts, note the checkpoint, close the run as succeeded or failed."""


class MlflowTracker(Tracker):
    """A run in an MLflow tracking store (the local file store by default: file:<run.dir>/mlruns)."""

    name = "mlflow"

    def __init__(self, mc: MlflowConfig, cfg: Config, run_dir: Path, previous: dict[str, Any] | None,
                 say: Callable[[str], None]) -> None:
        try:
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow", "mlflow (or mlflow-skinny)", "logging.mlflow.enabled") from None
        uri = mc.tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store only on request; the user asked for a local store here.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        same = previous is not None and previous.get("tracking_uri") == uri
        super().__init__({"tracking_uri": uri}, dict(previous["logged"]) if same else {})
        try:
            self.client = MlflowClient(tracking_uri=uri)
            params = flatten_config(cfg)
            if same and self._reopen(previous["run_id"], params, MlflowException):
                return
            if previous is not None:
                say(f"mlflow: run {previous['run_id']} of {previous.get('tracking_uri')} cannot be "
                    f"continued in {uri}; starting a new MLflow run")
            exp = self.client.get_experiment_by_name(mc.experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(mc.experiment)
            run = self.client.create_run(exp_id, run_name=mc.run_name or cfg.run.name,
                                         tags={"lmforge.run_dir": str(run_dir.resolve())})
            self.run_id = run.info.run_id
            self._log_params(params)
        except MlflowException as e:
            raise LmforgeError(f"logging.mlflow (tracking_uri {uri}, experiment {mc.experiment!r}): "
                               f"{e.message}; check logging.mlflow.tracking_uri") from None

    def _reopen(self, run_id: str, params: dict[str, str], error: type[Exception]) -> bool:
        """Continue `run_id`; False when the store no longer has it."""
        try:
            run = self.client.get_run(run_id)
        except error:
            return False
        self.run_id = run_id
        old = run.data.params
        self._log_params({k: v for k, v in params.items() if k not in old})
        # MLflow params are immutable: a value the resumed run changed (say train.max_steps) is a tag.
        for k, v in params.items():
            if k in old and old[k] != _cut(v):
                self.client.set_tag(run_id, f"lmforge.resumed_with.{k}", _cut(v))
        self.client.update_run(run_id, status="RUNNING")
        return True

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, _cut(v)) for k, v in params.items()]
        for i in range(0, len(items), _MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + _MLFLOW_PARAMS_PER_BATCH])

    def log(self, step: int, items: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, ts, step) for k, v in items.items()]
        for i in range(0, len(metrics), _MLFLOW_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + _MLFLOW_METRICS_PER_BATCH])
        self.logged.update(dict.fromkeys(items, step))

    def finish(self, artifacts: list[Path], checkpoint: Path | None, ok: bool) -> None:
        for path in artifacts:
            self.client.log_artifact(self.run_id, str(path))
        if checkpoint is not None:
            self.client.set_tag(self.run_id, "final_checkpoint", str(checkpoint.resolve()))
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def mlflow_key(key: str) -> str:
    """A metric's MLflow name: `/` becomes `.`, since the file store keeps `grad_norm/decay` as a file in
    a folder `grad_norm`, which cannot be one while the metric `grad_norm` is a file of that name."""
    return key.replace("/", ".")


def _cut(value: str) -> str:
    return value if len(value) <= _MLFLOW_PARAM_CHARS else value[:_MLFLOW_PARAM_CHARS - 3] + "..."


class WandbTracker(Tracker):
    """A W&B run, offline by default (<dir>/wandb/offline-run-*; `wandb sync` uploads it later)."""

    name = "wandb"

    def __init__(self, wc: WandbConfig, cfg: Config, run_dir: Path, previous: dict[str, Any] | None,
                 say: Callable[[str], None]) -> None:
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "wandb", "logging.wandb.enabled") from None
        wdir = Path(wc.dir) if wc.dir else run_dir
        identity = {"project": wc.project, "entity": wc.entity, "mode": wc.mode, "dir": str(wdir.resolve())}
        same = previous is not None and all(previous.get(k) == v for k, v in identity.items())
        super().__init__(identity, dict(previous["logged"]) if same else {})
        config = cfg.model_dump(mode="json")
        wdir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=wc.project, entity=wc.entity, mode=wc.mode, dir=str(wdir),
                name=wc.run_name or cfg.run.name, id=previous["run_id"] if same else None,
                resume="allow" if same else None, config=None if same else config, reinit="create_new",
                settings=wandb.Settings(console="off", silent=True, disable_git=True, save_code=False),
            )
            if same:  # the resumed run's config wins (say a raised train.max_steps)
                self.run.config.update(config, allow_val_change=True)
        except Exception as e:  # wandb raises its own errors (UsageError, CommError, AuthenticationError)
            raise LmforgeError(f"logging.wandb (project {wc.project!r}, mode {wc.mode}): {e}; for "
                               "logging.wandb.mode=online run `wandb login` first, or use mode=offline"
                               ) from None
        self.run_id = self.run.id
        # W&B merges what is logged at one step into one row and writes the row once a later step
        # arrives: the keys of the open row count as held only from then.
        self.row_step, self.row_keys = -1, []

    def log(self, step: int, items: dict[str, float]) -> None:
        if step < self.row_step:  # W&B's steps only increase (a rollback event names an earlier step)
            return
        if step > self.row_step:
            self._close_row()
            self.row_step = step
        self.run.log(items, step=step)
        self.row_keys.extend(items)

    def _close_row(self) -> None:
        self.logged.update(dict.fromkeys(self.row_keys, self.row_step))
        self.row_keys = []

    def finish(self, artifacts: list[Path], checkpoint: Path | None, ok: bool) -> None:
        self._close_row()
        for path in artifacts:  # the run's files dir is what W&B uploads with the run
            shutil.copy2(path, Path(self.run.dir) / path.name)
        if checkpoint is not None:
            self.run.summary["final_checkpoint"] = str(checkpoint.resolve())
        self.run.finish(exit_code=0 if ok else 1)


class Trackers:
    """The trackers of one run (none on other ranks or when none is enabled)."""

    def __init__(self, run_dir: Path, trackers: list[Tracker], say: Callable[[str], None],
                 kept: dict[str, Any] | None = None) -> None:
        self.run_dir, self.trackers, self.say = run_dir, trackers, say
        # trackers.json: the active trackers' runs, and those of trackers this session leaves off
        # (a later resume that enables one again continues its run)
        self.states: dict[str, Any] = {**(kept or {}), **{t.name: t.state() for t in trackers}}

    @classmethod
    def open(cls, cfg: Config, run_dir: Path, *, resumed: bool, is_main: bool,
             say: Callable[[str], None] = print) -> Trackers:
        """Start (or, when `resumed`, continue) the tracker runs the config enables."""
        lc = cfg.logging
        if not is_main or not (lc.mlflow.enabled or lc.wandb.enabled):
            return cls(run_dir, [], say)
        previous = _read_state(run_dir) if resumed else {}
        trackers: list[Tracker] = []
        try:
            if lc.mlflow.enabled:
                trackers.append(MlflowTracker(lc.mlflow, cfg, run_dir, previous.get("mlflow"), say))
            if lc.wandb.enabled:
                trackers.append(WandbTracker(lc.wandb, cfg, run_dir, previous.get("wandb"), say))
        except BaseException:
            for t in trackers:  # a tracker run already started ends as failed
                with contextlib.suppress(Exception):
                    t.finish([], None, ok=False)
            raise
        out = cls(run_dir, trackers, say, kept=previous)
        out._save()
        return out

    def log(self, record: dict[str, Any]) -> None:
        """Hand one metrics record to every tracker (the steps each one holds already are left out)."""
        if not self.trackers:
            return
        step, items = int(record.get("step", 0)), record_items(record)
        for t in list(self.trackers):
            fresh = t.fresh(step, items)
            if fresh:
                self._guarded(t, lambda t=t, fresh=fresh: t.log(step, fresh))
        self._save()

    def finish(self, checkpoint: Path | None, ok: bool) -> None:
        """Log the final artifacts and the checkpoint path, and end every tracker run."""
        if not self.trackers:
            return
        artifacts = [self.run_dir / n for n in ARTIFACTS if (self.run_dir / n).is_file()]
        for t in list(self.trackers):
            self._guarded(t, lambda t=t: t.finish(artifacts, checkpoint, ok))
        self._save()
        self.trackers = []

    def _guarded(self, tracker: Tracker, call: Callable[[], None]) -> None:
        # A tracker that fails mid-run (a full disk, a lost server) must not end the training:
        # metrics.jsonl has every record; the tracker is dropped for the rest of the run.
        try:
            call()
        except Exception as e:
            self.trackers.remove(tracker)
            self.say(f"{tracker.name}: logging failed ({type(e).__name__}: {e}); the {tracker.name} run "
                     f"{tracker.run_id} stops here; metrics.jsonl has every record")

    def _save(self) -> None:
        self.states.update({t.name: t.state() for t in self.trackers})
        # Written beside and renamed over (a kill never leaves half a file), without the fsync of
        # atomic_write_json: this runs at every log step, and it need only survive what the trackers'
        # own files survive (a killed process, not a power cut; the MLflow file store does not fsync).
        path = self.run_dir / STATE_FILE
        fd, tmp = tempfile.mkstemp(prefix=f".{STATE_FILE}.", suffix=".tmp", dir=self.run_dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.states, f, indent=1, sort_keys=True)
            os.replace(tmp, check_replaceable(path))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
