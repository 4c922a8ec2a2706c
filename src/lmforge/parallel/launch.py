"""`lmforge train --nproc N [--nnodes M --node-rank R --master-addr A --master-port P]`: start torch's
elastic agent in this process, each worker running `python -m lmforge <verb> <the same arguments minus
these flags>`, as `torchrun --nproc-per-node N ... -m lmforge <verb> ...` would.

The agent is torch.distributed.run's own (its argument parser, `config_from_args` and `run`, which calls
`elastic_launch`), so workers get torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT,
TORCHELASTIC_*, OMP_NUM_THREADS=1 with several workers) and the agent forwards SIGINT/SIGTERM/SIGHUP to
them, so a run saves and stops as under torchrun. What differs from torchrun is deliberate:

- what the config refuses for the job's world size is refused here, once, before any worker starts;
- the exit status is the first failed worker's (torchrun exits 1 whatever the worker said), and the
  agent's log and ChildFailedError tracebacks are left out: a worker that failed with an lmforge error
  has printed it (rank 0 once, for a config error); any other failure gets one line here.

`--nproc auto` is the number of CUDA devices, or 1 without one: on a CPU one process already uses every
core (gloo ranks on one CPU split the cores between them), so more processes only add communication.
One process on one node runs in this process, without an agent (the same world of one).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass

from lmforge.errors import ConfigError

# The launcher's flags: (flag, dest). Every one takes a value.
FLAGS = (("--nproc", "nproc"), ("--nnodes", "nnodes"), ("--node-rank", "node_rank"),
         ("--master-addr", "master_addr"), ("--master-port", "master_port"))
DEFAULT_PORT = 29500  # torchrun's, for a multi-node job without --master-port
# Exit statuses with which an lmforge worker has already said what went wrong (cli/__init__.py): a user
# error (2), a diverged run (3), a run interrupted by SIGINT/SIGTERM that saved a checkpoint.
_REPORTED = {2, 3, 128 + signal.SIGINT, 128 + signal.SIGTERM}


@dataclass(frozen=True)
class Launch:
    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str | None
    master_port: int | None

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def in_process(self) -> bool:
        """One worker in all: run it here (an agent would only add a process start)."""
        return self.world_size == 1


def requested(args) -> bool:
    """Whether any launcher flag was given."""
    return any(getattr(args, dest, None) is not None for _, dest in FLAGS)


def _count(flag: str, value: str, lo: int, hi: int) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = None
    if n is None or not lo <= n <= hi:
        raise ConfigError(f"{flag}: expected a whole number from {lo} to {hi}, got {value!r}")
    return n


def _nproc(value: str | None) -> int:
    if value is None:
        return 1  # torchrun's default: --nnodes M alone starts one worker per node
    if value == "auto":
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 1
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or n < 1:
        raise ConfigError(f"--nproc: expected the number of processes per node (>= 1) or auto (one per GPU, "
                          f"1 on a CPU), got {value!r}")
    return n


def resolve(args) -> Launch:
    """The launch the flags ask for, or a ConfigError naming the flag and what would work."""
    if "WORLD_SIZE" in os.environ:
        given = " ".join(flag for flag, dest in FLAGS if getattr(args, dest, None) is not None)
        raise ConfigError(f"{given} starts the processes itself, but this process is already one of a "
                          f"launched job (WORLD_SIZE={os.environ['WORLD_SIZE']} is set, e.g. by torchrun): "
                          "drop the launcher flags, or run lmforge without torchrun")
    nnodes = _count("--nnodes", args.nnodes, 1, 1 << 16) if args.nnodes is not None else 1
    node_rank = _count("--node-rank", args.node_rank, 0, 1 << 16) if args.node_rank is not None else 0
    if node_rank >= nnodes:
        raise ConfigError(f"--node-rank {node_rank} is not below --nnodes {nnodes}: node ranks run from 0 to "
                          f"{nnodes - 1}")
    if nnodes > 1 and not args.master_addr:
        raise ConfigError(f"--nnodes {nnodes} needs --master-addr: the address of node rank 0 (where the job "
                          "meets), the same on every node")
    port = _count("--master-port", args.master_port, 1, 65535) if args.master_port is not None else None
    return Launch(_nproc(args.nproc), nnodes, node_rank, args.master_addr, port)


def check_layout(cfg, job: Launch) -> None:
    """Refuse here, once, a parallel layout the job's world size cannot run (each worker would refuse it
    again after starting torch). The model's own checks are left to the workers: a model may only take
    its final shape there (a tokenizer's vocabulary, a checkpoint's config)."""
    from lmforge.parallel.dims import ParallelDims

    ParallelDims.resolve(cfg.parallel, job.world_size, None, cfg.train.grad_accum_steps)


def worker_argv(argv: list[str], takes_value: dict[str, bool]) -> list[str]:
    """`argv` without the launcher's flags and their values. `takes_value` maps each long or short option
    of the verb to whether it takes a value, so that a value is never read as a flag and an abbreviation
    argparse accepted (--npro 2) is recognised as the flag it stands for."""
    launcher = {flag for flag, _ in FLAGS}
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return out + argv[i:]
        name, eq, _ = token.partition("=")
        full = name if name in takes_value else None
        if full is None and name.startswith("--"):
            matches = [o for o in takes_value if o.startswith(name)]
            full = matches[0] if len(matches) == 1 else None
        skip_value = full is not None and takes_value[full] and not eq
        if full not in launcher:
            out.append(token)
            if skip_value and i + 1 < len(argv):
                out.append(argv[i + 1])
        i += 2 if skip_value else 1
    return out


def _torchrun_args(job: Launch, worker: list[str]):
    """torch.distributed.run's own parsed arguments for this launch."""
    from torch.distributed.run import get_args_parser

    flags = ["--nproc-per-node", str(job.nproc), "--nnodes", str(job.nnodes)]
    if job.nnodes > 1:
        # Static rendezvous, as `torchrun --nnodes M --node-rank R --master-addr A --master-port P`.
        flags += ["--node-rank", str(job.node_rank), "--master-addr", job.master_addr,
                  "--master-port", str(job.master_port or DEFAULT_PORT)]
    elif job.master_port is not None or job.master_addr:
        # Asked for: meet there (torchrun would ignore an address given without a port).
        flags += ["--master-addr", job.master_addr or "127.0.0.1", "--master-port",
                  str(job.master_port or DEFAULT_PORT)]
    # Otherwise torchrun's run() meets on a free localhost port (c10d), never a busy 29500.
    return get_args_parser().parse_args([*flags, "-m", "lmforge", *worker])


def _status(code: int) -> int:
    """A worker's exit status as a shell reports it: a signal N is 128 + N."""
    return 128 - code if code < 0 else code


def launch(verb: str, job: Launch, worker: list[str]) -> int:
    """Run the job; returns the exit status (0, or the first failed worker's)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import run

    args = _torchrun_args(job, worker)
    # The agent's log (a banner about OMP_NUM_THREADS, each worker's start and stop, the failure again)
    # repeats what the workers said or what is said below in one line.
    quiet = [logging.getLogger(n) for n in ("torch.distributed.run", "torch.distributed.elastic")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    try:
        run(args)
    except RendezvousError as e:
        raise ConfigError(f"the job's {job.nnodes} node(s) did not meet ({type(e).__name__}: {e}); check "
                          "that --master-addr/--master-port are node rank 0's and reachable, and that every "
                          "node was started with the same --nnodes") from None
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = _status(failure.exitcode)
        if code not in _REPORTED:
            how = (f"was killed by {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0
                   else f"exited with status {code}")
            print(f"lmforge {verb}: error: rank {rank} {how} (its output is above)", file=sys.stderr)
        return code
    except SignalException as e:  # the agent forwarded it to the workers and waited for them to stop
        return 128 + int(e.sigval)
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    return 0
