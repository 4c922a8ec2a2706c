"""What one job may ask of the machine, and what the server lets run at once.

A job asks for processes (its parallel layout or `nproc`), threads (per process: train.threads, else what
the server gives it through OMP_NUM_THREADS) and memory (a floor: what its model's trained weights need at
the least, plus what a Python + torch process holds before any model; `memory_floor`). An ask over a per-job
bound is refused when the job is submitted (422); a job that fits waits in the queue until the running jobs
leave room for it, in total and for its user. What a job really uses is watched while it runs (runner.py):
one over its memory bound, or the running jobs together over theirs, is stopped before the kernel's out-of-
memory killer picks processes at random.

Defaults come from the machine: processes and threads per job from its usable CPUs, memory from its physical
memory (or the cgroup's limit, when lower), keeping a tenth for the server and the system.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmforge.errors import LmforgeError

GIB = 1 << 30
# A job process before its model: Python, torch and lmforge imported, allocator arenas (a tiny CPU run
# peaks at ~0.4 GiB resident with the shared libraries; 0.5 GiB keeps a margin).
PROCESS_BASE_BYTES = GIB // 2
MACHINE_SHARE = 0.9  # of the machine's memory, for all jobs together by default


def machine_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as a container or taskset limits it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def machine_memory() -> int:
    """Bytes of memory here: physical memory, or the cgroup (v2 or v1) limit when that is lower."""
    total = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError):
        pass
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            total = 8 * GIB
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(f).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < total:
            total = int(raw)
    return total


@dataclass(frozen=True)
class Ask:
    """What a job asks: processes, threads per process, memory in bytes (the whole job)."""

    procs: int
    threads: int
    memory: int

    @classmethod
    def of(cls, spec: dict[str, Any], nproc: int = 1) -> Ask:
        """The ask stored in a job's spec (a job made before asks were recorded: its processes only)."""
        a = spec.get("ask") or {}
        return cls(int(a.get("procs", nproc)), int(a.get("threads", 1)), int(a.get("memory", 0)))

    def to_json(self) -> dict[str, int]:
        return asdict(self)


class OverAsk(LmforgeError):
    """A job asks for more than this server lets one job have; `param` names what."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class Limits:
    """The server's bounds (memory in bytes)."""

    max_procs_per_job: int
    max_threads_per_job: int
    max_memory_per_job: int
    max_procs: int  # all running jobs together
    max_procs_per_user: int  # one user's running jobs together
    max_memory: int  # all running jobs together

    @classmethod
    def for_machine(cls, max_procs_per_job: int | None = None, max_threads_per_job: int | None = None,
                    max_memory_gb: float | None = None, max_procs: int | None = None,
                    max_procs_per_user: int | None = None, max_memory_gb_total: float | None = None,
                    max_running: int = 1) -> Limits:
        """The bounds given, the rest from this machine; LmforgeError naming the option for a value that is
        not a finite number in range."""
        cpus, memory = machine_cpus(), machine_memory()
        whole = _count("--max-procs", max_procs, 2 * max(cpus, max_running))
        per_job = _count("--max-procs-per-job", max_procs_per_job, cpus)
        per_user = _count("--max-procs-per-user", max_procs_per_user, whole)
        threads = _count("--max-threads-per-job", max_threads_per_job, cpus)
        total_mem = _gigabytes("--max-memory-gb-total", max_memory_gb_total, MACHINE_SHARE * memory / GIB)
        job_mem = _gigabytes("--max-memory-gb", max_memory_gb, total_mem / GIB)
        if per_job > whole:
            raise LmforgeError(f"--max-procs-per-job {per_job} exceeds --max-procs {whole} (all running jobs "
                               "together): no such job could ever start; lower it or raise --max-procs")
        if per_user > whole:
            raise LmforgeError(f"--max-procs-per-user {per_user} exceeds --max-procs {whole}; lower it or "
                               "raise --max-procs")
        if job_mem > total_mem:
            raise LmforgeError(f"--max-memory-gb {job_mem / GIB:g} exceeds --max-memory-gb-total "
                               f"{total_mem / GIB:g}: no such job could ever start; lower it")
        return cls(per_job, threads, job_mem, whole, per_user, total_mem)

    def check(self, ask: Ask) -> None:
        """OverAsk if one job asks for more than any job may have."""
        if ask.procs > self.max_procs_per_job:
            raise OverAsk(f"nproc: the job needs {ask.procs} processes; this server runs at most "
                          f"{self.max_procs_per_job} for one job (--max-procs-per-job): lower nproc or the "
                          "parallel layout", "nproc")
        if ask.procs > self.max_procs_per_user:
            raise OverAsk(f"nproc: the job needs {ask.procs} processes; this server runs at most "
                          f"{self.max_procs_per_user} for one user (--max-procs-per-user)", "nproc")
        if ask.procs * ask.threads > self.max_threads_per_job:
            raise OverAsk(f"train.threads: {ask.procs} process(es) x {ask.threads} threads = "
                          f"{ask.procs * ask.threads} threads; this server gives one job at most "
                          f"{self.max_threads_per_job} (--max-threads-per-job): lower train.threads or leave "
                          "it unset (the server then divides its threads between the processes)",
                          "train.threads")
        if ask.memory > self.max_memory_per_job:
            raise OverAsk(f"the job needs at least {_gib(ask.memory)} of memory (its model's weights and "
                          f"gradients alone, plus {_gib(PROCESS_BASE_BYTES)} for each of its {ask.procs} "
                          f"process(es)); this server gives one job at most {_gib(self.max_memory_per_job)} "
                          "(--max-memory-gb): train a smaller model, or adapters (finetune.method lora or "
                          "qlora)", "model")

    def threads_for(self, procs: int) -> int:
        """Threads per process of a job that does not choose (train.threads unset): its share."""
        return max(1, self.max_threads_per_job // max(1, procs))

    def wait_reason(self, ask: Ask, user: str, running: list[tuple[str, Ask]]) -> str | None:
        """None if a job of `user` asking `ask` may start beside the `running` (user, ask) pairs; else
        "user" (its user's running jobs leave no room: other users' jobs may go first) or "total"."""
        mine = sum(a.procs for u, a in running if u == user)
        if mine + ask.procs > self.max_procs_per_user:
            return "user"
        if sum(a.procs for _, a in running) + ask.procs > self.max_procs:
            return "total"
        if sum(a.memory for _, a in running) + ask.memory > self.max_memory:
            return "total"
        return None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "max_memory_per_job": self.max_memory_per_job / GIB,
                "max_memory": self.max_memory / GIB}


def _count(option: str, value: Any, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
        raise LmforgeError(f"{option} {value!r}: give a whole number from 1 to 1000000")
    return value


def _gigabytes(option: str, value: Any, default: float) -> int:
    v = default if value is None else value
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 1 << 20:
        raise LmforgeError(f"{option} {value!r}: give a finite number of GiB above 0")
    return max(1, int(v * GIB))


# -- the memory a training job needs at least --------------------------------------------------------
# Bytes per parameter the trained weights hold at the least: fp32 weights and gradients (full), a frozen
# base in 16 bits (LoRA / DoRA), NF4 (QLoRA). Optimizer state, activations and logits come on top, so
# this floor refuses only what surely cannot fit; the watchdog bounds the rest.
_BYTES_PER_PARAM = {"full": 8.0, "lora": 2.0, "dora": 2.0, "qlora": 0.5}


def model_params(m: Any, vocab: int) -> int:
    """Parameters of the matrices of a decoder described by a ModelConfig (norms and biases left out)."""
    d, layers = m.d_model, m.n_layers
    if m.mla is not None or (m.moe is not None and m.moe.dense_layers):
        # Latent attention and dense first blocks (DeepSeek-V3): the exact count (still a floor).
        from lmforge.models.flops import count_params

        return count_params(m.model_copy(update={"vocab_size": vocab}))
    heads, kv, hd = m.n_heads, m.resolved_kv_heads, m.resolved_head_dim
    attn = 2 * d * heads * hd + 2 * d * kv * hd
    mats = 3 if m.mlp in ("swiglu", "geglu") else 2
    if m.moe is not None:
        mlp = m.moe.n_experts * mats * d * (m.moe.d_ff_expert or m.resolved_d_ff)
    else:
        mlp = mats * d * m.resolved_d_ff
    return vocab * d * (1 if m.tie_embeddings else 2) + layers * (attn + mlp)


def memory_floor(cfg: Any, procs: int, model: Any = None) -> int:
    """Bytes a training job of `cfg` on `procs` processes needs at the least (`model`: the model section
    the run will really build, when init_from gives another than cfg.model)."""
    m = model or cfg.model
    vocab = m.vocab_size or 64 * math.ceil(cfg.data.tokenizer.vocab_size / 64)
    per_param = _BYTES_PER_PARAM.get(cfg.finetune.method, 8.0)
    return procs * PROCESS_BASE_BYTES + int(model_params(m, vocab) * per_param)
