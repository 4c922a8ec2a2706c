"""Save, find and restore training checkpoints: atomic, with keep-last-k retention.

Layout of one checkpoint (a directory, so sharded saves drop in without changing it):

    <run.dir>/checkpoints/step_00000100/
        state/               model + optimizer via torch.distributed.checkpoint (one file per rank)
        rank_00000.pt        per-rank run state: {"format": 3, "states": {name: state_dict}} of every
                             Stateful part the trainer holds (progress, data loader, RNG, scaler, ...)
        meta.json            step, world size, parameter shapes; written last

A checkpoint is written into `.tmp-step_...` and renamed into place only once complete, so a
crash or a full disk mid-save never damages the previous one, and any `step_*` directory that
exists is whole. Model and optimizer go through `torch.distributed.checkpoint` with FQN-keyed
state dicts, which is what lets the distributed issue save shards and load them into another
world size without changing this layout.

Distributed saves: every rank writes its shards and its rank file into the same tmp directory;
barriers make rank 0 clear a stale tmp before anyone writes and rename only after everyone has.
Optimizer state is saved flattened (one key per parameter FQN, param-group settings included), so
ranks holding different parameters (pipeline stages, ZeRO-1 partitions) save and load it in any
layout; format 1 checkpoints (nested optimizer state) still load.

The manager never knows what the run state consists of: it saves `{name: part.state_dict()}` of the
Stateful parts it is given and hands each its own state back on load. Formats 1-2 wrote one flat
dict of named fields; `migrate_run_state` turns it into format 3's named parts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from lmforge.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner, read_metadata
from lmforge.errors import CheckpointError, CheckpointMismatchError, LmforgeError
from lmforge.utils.io import atomic_write_json, disk_error, fsync_dir

_STEP_DIR = re.compile(r"^step_(\d{8})$")
FORMAT_VERSION = 3  # 3: run state as named Stateful parts; 2: flattened optimizer state; 1: nested


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class Loaded:
    """What `CheckpointManager.load` restored: the step, the run-state parts and the weight averages
    the checkpoint held (a part switched on after it was written keeps its fresh state)."""

    step: int
    states: set[str] = field(default_factory=set)
    averages: list[str] = field(default_factory=list)


def migrate_run_state(state: dict[str, Any]) -> dict[str, Any]:
    """A rank file's run state as format 3's {part name: state}. Formats 1-2 held one flat dict
    (step, tokens_seen, skipped_steps, loader, rng, precision, lr_scale, guard, spikes, early, averages;
    the older the fewer)."""
    if "states" in state:
        return state["states"]
    out: dict[str, Any] = {
        "progress": {"step": int(state.get("step", 0)), "tokens_seen": int(state.get("tokens_seen", 0)),
                     "skipped_steps": int(state.get("skipped_steps", 0))},
        "control": {"lr_scale": float(state.get("lr_scale", 1.0))},
    }
    for name in ("loader", "rng", "precision", "guard", "spikes", "early", "averages"):
        if state.get(name) is not None:
            out[name] = state[name]
    return out


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _options(fmt: int = FORMAT_VERSION) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=fmt >= 2)


def _optimizers(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    """What DCP sees of `optimizer`: a ZeRO-1 wrapper's state lives in its local optimizer (the
    parameters this rank owns); the wrapper's own state_dict needs a gather to one rank."""
    if optimizer is None:
        return []
    # Looked up, not imported: importing torch.distributed.optim costs a second and dozens of
    # TorchScript deprecation warnings, and a ZeRO optimizer exists only if it was imported.
    zero = sys.modules.get("torch.distributed.optim")
    return [optimizer.optim if zero and isinstance(optimizer, zero.ZeroRedundancyOptimizer) else optimizer]


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int


def list_checkpoints(ckpt_root: Path) -> list[CheckpointInfo]:
    """Complete checkpoints under `ckpt_root`, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for child in ckpt_root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / "meta.json").is_file():
            found.append(CheckpointInfo(child, int(m.group(1))))
    return sorted(found, key=lambda c: c.step)


def param_shapes(model: nn.Module) -> dict[str, list[int]]:
    """FQN -> shape of the whole model; in a distributed job the union over ranks (a pipeline
    rank holds only its stages), so every rank must call it."""
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    if _distributed():
        parts: list[dict[str, list[int]]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(parts, shapes)
        shapes = {k: v for part in parts for k, v in part.items()}
    return shapes


def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or meta["step"] < 0:
        raise CheckpointError(f"checkpoint {path} is unreadable: its meta.json is not an object with a step "
                              "(a checkpoint written by lmforge has one)")
    shapes = meta.get("param_shapes", {})
    if not isinstance(shapes, dict) or not all(isinstance(v, list) for v in shapes.values()):
        raise CheckpointError(f"checkpoint {path} is unreadable: its meta.json param_shapes are malformed")
    return meta


def check_shapes(path: Path, meta: dict[str, Any], model: nn.Module) -> None:
    """Refuse, with the first differing tensor named, to load a checkpoint of another model shape."""
    saved = meta.get("param_shapes", {})
    current = param_shapes(model)
    if saved == current:
        return
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    differ = [k for k in current if k in saved and saved[k] != current[k]]
    if differ:
        k = differ[0]
        detail = f"{k} is {tuple(saved[k])} in the checkpoint but {tuple(current[k])} in the config"
    elif missing == ["final_norm.bias", "final_norm.weight"] or missing == ["final_norm.weight"]:
        raise CheckpointMismatchError(
            f"checkpoint {path} holds an encoder with Post-LN blocks, but the config builds Pre-LN ones "
            "(model.norm_placement: pre); set model.norm_placement: post_ln (BERT's; configs written "
            "before norm_placement applied to encoders say pre for it) in the run's config.yaml")
    elif missing:
        detail = f"the config's model has {missing[0]!r}, which the checkpoint lacks"
    else:
        detail = f"the checkpoint has {extra[0]!r}, which the config's model lacks"
    raise CheckpointMismatchError(
        f"checkpoint {path} holds a model of a different shape ({detail}); resume it with the "
        "model config it was trained with, or start a new run (another run.dir, or run.overwrite=true)"
    )


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every single-process save/load that it assumes one process (intended), and logs
    the tracebacks of reads it retries on the root logger; the error that ends a load is ours to say."""
    dcp_noise = _DropDCPLogs()
    root = logging.getLogger()
    root.addFilter(dcp_noise)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        root.removeFilter(dcp_noise)


class _DropDCPLogs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "torch/distributed/checkpoint" not in record.pathname.replace("\\", "/")


def _find_os_error(e: BaseException) -> OSError | None:
    """The OSError behind `e`, also when DCP wrapped it in a CheckpointException per rank."""
    return _find_error(e, OSError)


def _find_error(e: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first `kind` behind `e` (itself, its causes, or the per-rank failures DCP wraps)."""
    seen = 0
    stack = [e]
    while stack and seen < 20:
        cur = stack.pop()
        seen += 1
        if isinstance(cur, kind) and not (cur is e and isinstance(cur, CheckpointException)):
            return cur
        failures = getattr(cur, "failures", None)
        if isinstance(failures, dict):  # rank -> (exception, traceback frames)
            for f in failures.values():
                f = f[0] if isinstance(f, tuple) and f else f
                if isinstance(f, BaseException):
                    stack.append(f)
        for nxt in (cur.__cause__, cur.__context__):
            if nxt is not None:
                stack.append(nxt)
    return None


class CheckpointManager:
    """Writes and restores checkpoints of one run directory."""

    def __init__(self, run_dir: Path, keep_last: int, rank: int = 0, world_size: int = 1) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size

    # -- save ---------------------------------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             states: Mapping[str, Stateful], averages: dict[str, dict[str, torch.Tensor]] | None = None,
             name: str | None = None) -> Path:
        """Write checkpoint `step` atomically and apply retention. Returns its path.

        `states`: the run's Stateful parts by name; each one's state_dict() goes into this rank's file.
        Without an optimizer only the model is saved (an imported model: a run at step 0).
        `averages` (kind -> FQN -> tensor: the EMA/SWA weights) are saved beside the model.
        `name` (e.g. "best") saves outside the step sequence and its retention."""
        final = self.root / (name or f"step_{step:08d}")
        tmp = self.root / f".tmp-{final.name}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists() and self.rank == 0:
                shutil.rmtree(tmp)
            _barrier()
            model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer), options=_options())
            state = {"model": model_sd, "optim": optim_sd} if optimizer else {"model": model_sd}
            if averages:
                state["averaging"] = averages
            with _quiet_single_process():
                dcp.save(state, checkpoint_id=str(tmp / "state"))
            run_state = {"format": FORMAT_VERSION, "states": {k: v.state_dict() for k, v in states.items()}}
            torch.save(run_state, tmp / f"rank_{self.rank:05d}.pt")
            shapes = param_shapes(model)
            _barrier()
            if self.rank == 0:
                meta = {
                    "format": FORMAT_VERSION,
                    "step": step,
                    "world_size": self.world_size,
                    "param_shapes": shapes,
                }
                atomic_write_json(tmp / "meta.json", meta)
                fsync_dir(tmp)
                aside = self.root / f".old-{final.name}"
                if final.exists():  # a re-save of the same step (e.g. after a rollback), or "best":
                    shutil.rmtree(aside, ignore_errors=True)  # moved aside, so one always exists
                    os.replace(final, aside)
                os.replace(tmp, final)
                shutil.rmtree(aside, ignore_errors=True)
                fsync_dir(self.root)
                self._retain()
            _barrier()  # nobody lists or loads checkpoints before the rename
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            os_error = _find_os_error(e)
            if os_error is not None:
                raise disk_error(os_error, f"checkpoint {final}") from None
            raise
        return final

    def _retain(self) -> None:
        ckpts = list_checkpoints(self.root)
        for old in ckpts[: max(0, len(ckpts) - self.keep_last)]:
            shutil.rmtree(old.path, ignore_errors=True)
        for stale in self.root.glob(".tmp-*"):  # left by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)

    def set_aside(self, path: Path) -> Path:
        """Move an unreadable checkpoint out of the step sequence (retention and resume no longer see
        it; nothing is deleted): checkpoints/unreadable/<name>[.N]."""
        aside = self.root / "unreadable"
        aside.mkdir(exist_ok=True)
        target, n = aside / path.name, 1
        while target.exists():
            target, n = aside / f"{path.name}.{n}", n + 1
        os.replace(path, target)
        fsync_dir(self.root)
        return target

    # -- load ---------------------------------------------------------------------------------
    def latest(self) -> CheckpointInfo | None:
        ckpts = list_checkpoints(self.root)
        return ckpts[-1] if ckpts else None

    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        states: Mapping[str, Stateful],
        averages: dict[str, dict[str, torch.Tensor]] | None = None,
    ) -> Loaded:
        """Restore model, optimizer and the `averages` tensors in place from checkpoint `path`, then
        hand each of `states` its saved state (parts the checkpoint lacks are left as they are)."""
        step = load_states(path, model, optimizer)
        loaded = [k for k in (averages or {}) if k in saved_averages(path)]
        if loaded:
            _dcp_load({"averaging": {k: averages[k] for k in loaded}}, path)
        state = self.read_run_state(path)
        try:
            saved = migrate_run_state(state)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path}: its run state is malformed "
                                  f"({type(e).__name__}: {e})") from None
        for name, part in states.items():
            if name not in saved:
                continue
            try:
                part.load_state_dict(saved[name])
            except LmforgeError:
                raise  # the part's own verdict (e.g. a data loader saved for other data)
            except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"checkpoint {path}: its {name!r} state is malformed "
                                      f"({type(e).__name__}: {e})") from None
        return Loaded(step, set(saved) & set(states), loaded)

    def read_run_state(self, path: Path) -> dict[str, Any]:
        """This rank's run-state file of checkpoint `path` (no pickle: tensors and plain data only)."""
        rank_file = path / f"rank_{self.rank:05d}.pt"
        if not rank_file.exists() and (path / "rank_00000.pt").exists():
            # Resumed on more ranks than saved: the data position is the same on every rank (it is
            # global); RNG streams of the new ranks start from rank 0's.
            rank_file = path / "rank_00000.pt"
        try:
            return torch.load(rank_file, weights_only=True)
        except Exception as e:  # weights_only refuses anything but tensors and plain data
            reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise CheckpointError(f"cannot read train state {rank_file}: {reason}") from None


def saved_averages(path: Path) -> set[str]:
    """Kinds of weight averages ('ema', 'swa') checkpoint `path` holds."""
    try:
        keys = read_metadata(str(path / "state")).state_dict_metadata
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    return {k.split(".")[1] for k in keys if k.startswith("averaging.")}


def _dcp_load(state: dict, path: Path) -> None:
    """Load `state` in place from checkpoint `path` through the reader and planner that run no code
    from the files (checkpoint/safe_dcp.py)."""
    try:
        # Read (or refused) here, before DCP's own reader would retry and log; then parsed only once.
        reader = SafeFileSystemReader(str(path / "state"), read_metadata(str(path / "state")))
        with _quiet_single_process():
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        ours = _find_error(e, CheckpointError)
        raise ours if ours is not None else CheckpointError(f"cannot read checkpoint {path}: "
                                                            f"{_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    cause = _find_error(e, Exception) if isinstance(e, CheckpointException) else e
    text = f"{type(cause).__name__}: {cause}" if cause is not None else str(e)
    return text.splitlines()[0] if text else type(e).__name__


def load_states(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                weights: str = "model") -> int:
    """Load model (and optimizer) state of checkpoint `path` in place. Returns its step.

    `weights` 'ema' or 'swa' loads that weight average into the model instead of the trained weights."""
    meta = read_meta(path)
    check_shapes(path, meta, model)
    if weights != "model":
        if weights not in saved_averages(path):
            have = sorted(saved_averages(path))
            raise CheckpointError(
                f"checkpoint {path} holds no {weights} weights (it has: model"
                + "".join(f", {k}" for k in have) + f"); train with averaging.{weights}=true to keep them"
            )
        # The average is FQN-keyed like the model, so DCP loads it straight into the parameters. It
        # holds the parameters that trained: with a frozen base (adapters) the rest are the model's.
        prefix = f"averaging.{weights}."
        held = {k[len(prefix):] for k in read_metadata(str(path / "state")).state_dict_metadata
                if k.startswith(prefix)}
        params = dict(model.named_parameters())
        if not set(params) <= held:
            load_states(path, model)
        _dcp_load({"averaging": {weights: {n: p for n, p in params.items() if n in held}}}, path)
        return int(meta["step"])
    optimizers = _optimizers(optimizer)
    options = _options(int(meta.get("format", 1)))
    model_sd, optim_sd = get_state_dict(model, optimizers, options=options)
    state = {"model": model_sd, "optim": optim_sd} if optimizer is not None else {"model": model_sd}
    _dcp_load(state, path)
    set_state_dict(model, optimizers, model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}), options=options)
    return int(meta["step"])
