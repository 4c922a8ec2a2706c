"""Measure what a training step really takes on the CPU, to hold `lmforge estimate` to it.

Each configuration runs in fresh processes (one per rank, with torchrun's environment on gloo): the
runtime is warmed up first (a tiny model's forward, backward and optimizer step, a collective), then
the peak-RSS counter is reset (`/proc/self/clear_refs` 5) and the baseline RSS read; the model is built,
parallelized and trained for a few steps of random tokens through the real `ParallelModel.step`,
and the measured peak is VmHWM - baseline.

glibc malloc is pinned with MALLOC_MMAP_THRESHOLD_=65536 (a fixed threshold, which also turns off
its dynamic growth): every tensor above 64 KiB is its own mapping, returned to the system when freed,
so RSS follows the live tensors instead of freed memory kept in the heap; MALLOC_ARENA_MAX=2 keeps
gloo's and autograd's threads from each growing an arena. One OpenMP thread per process.

    python -m lmforge.tools.estimate_measure SPEC.json OUT_DIR     (a worker; use `measure` instead)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.config.methods import method_facts
from lmforge.parallel.local_ranks import run_ranks

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}


class LiveOutputs(TorchDispatchMode):
    """Weak references to every op output made under it: the storages still alive after a forward are
    what its backward keeps (activation checkpointing's kept outputs included)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t))
        return out

    def live_bytes(self) -> int:
        """Bytes of the distinct storages of the outputs that are still alive."""
        storages = {}
        for ref in self.refs:
            t = ref()
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def measure(config: dict, world_size: int = 1, steps: int = 3, timeout: float = 600.0) -> list[int]:
    """Peak RSS bytes over baseline of each rank training `config` (a Config mapping) for `steps`."""
    src = str(Path(__file__).resolve().parents[2])
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"config": config, "steps": steps}))
        cmd = [sys.executable, "-m", "lmforge.tools.estimate_measure", str(spec), tmp]
        run_ranks(world_size, cmd, Path(tmp), env={**MALLOC_ENV, "PYTHONPATH": os.pathsep.join(
            [src, os.environ.get("PYTHONPATH", "")])}, timeout=timeout)
        return [json.loads((Path(tmp) / f"peak_{r}.json").read_text())["peak"] for r in range(world_size)]


BASE_MODEL = {"d_model": 256, "n_layers": 4, "n_heads": 4, "vocab_size": 8192, "max_seq_len": 256}


def _config(model: dict | None = None, train: dict | None = None, parallel: dict | None = None,
            optim: dict | None = None, **sections: dict) -> dict:
    return {"model": {**BASE_MODEL, **(model or {})},
            "train": {"precision": "fp32", "micro_batch_size": 8, "grad_clip": 1.0, **(train or {})},
            "parallel": parallel or {}, "optim": optim or {"name": "adamw"}, **sections}


def _method(objective: str, finetune: dict | None = None, train: dict | None = None) -> dict:
    return _config(train=train, objective={"name": objective}, finetune=finetune or {"method": "full"})


def grid() -> list[tuple[str, dict, int]]:
    """(name, config mapping, world size) of the configurations the estimate is held to: shapes x
    activation checkpointing x optimizers x layouts (single process, DDP, ZeRO-1/2/3, TP, PP with the
    GPipe, 1F1B and interleaved schedules), mixture of experts (one process, DDP + expert
    parallelism) and the fine-tuning methods (SFT full / LoRA / QLoRA, DPO full with its reference
    copy and LoRA, a reward model)."""
    return [
        ("1p d256 L4 B8 T256", _config(), 1),
        ("1p d256 L4 B8 T256 AC full", _config(train={"activation_checkpointing": "full"}), 1),
        ("1p d256 L4 B4 T256 AC every_2", _config(train={"micro_batch_size": 4,
                                                         "activation_checkpointing": "every_k"}), 1),
        ("1p d256 L4 B8 T256 AC selective", _config(train={"activation_checkpointing": "selective"}), 1),
        ("1p d256 L4 B8 T256 AC selective alternate", _config(train={"activation_checkpointing": "selective",
                                                                    "ac_save": "alternate_matmuls"}), 1),
        ("1p untied B8 T128 chunked loss", _config({"tie_embeddings": False},
                                                   {"seq_len": 128, "loss_chunk_tokens": 512}), 1),
        ("1p d384 L6 gelu/LN B4 accum 2", _config({"d_model": 384, "n_layers": 6, "n_heads": 6, "mlp": "gelu",
                                                   "norm": "layernorm"},
                                                  {"micro_batch_size": 4, "grad_accum_steps": 2}), 1),
        ("1p GQA window B4 adafactor", _config({"n_kv_heads": 2, "sliding_window": 128},
                                               {"micro_batch_size": 4}, optim={"name": "adafactor"}), 1),
        ("1p d256 L4 B4 lion", _config(train={"micro_batch_size": 4}, optim={"name": "lion"}), 1),
        ("DDP 2 B4", _config(train={"micro_batch_size": 4}, parallel={"dp_replicate": 2, "dp_shard": 1}), 2),
        ("ZeRO-1 2 B4", _config(train={"micro_batch_size": 4}, parallel={"zero": 1}), 2),
        ("FSDP zero2 2 B4", _config(train={"micro_batch_size": 4}, parallel={"zero": 2}), 2),
        ("FSDP zero3 2 B4", _config(train={"micro_batch_size": 4}, parallel={"zero": 3}), 2),
        ("FSDP zero3 2 B8 AC full", _config(train={"activation_checkpointing": "full"},
                                            parallel={"zero": 3}), 2),
        ("TP 2 SP B4", _config(train={"micro_batch_size": 4}, parallel={"tp": 2, "dp_shard": 1}), 2),
        ("1p MoE 8 experts top-2 B4", _config({"moe": {"n_experts": 8, "top_k": 2}},
                                              {"micro_batch_size": 4}), 1),
        ("1p MoE shared + capacity B4", _config({"moe": {"n_experts": 4, "top_k": 1, "n_shared_experts": 1,
                                                         "shared_gate": True, "capacity_factor": 1.25}},
                                                {"micro_batch_size": 4}), 1),
        ("DDP 2 + EP 2 MoE B4", _config({"moe": {"n_experts": 8, "top_k": 2}}, {"micro_batch_size": 4},
                                        {"dp_replicate": 2, "dp_shard": 1, "ep": 2}), 2),
        ("PP 2 1F1B 2 x B4", _config(train={"micro_batch_size": 4, "grad_accum_steps": 2},
                                     parallel={"pp": 2, "dp_shard": 1, "pp_schedule": "1f1b"}), 2),
        ("PP 2 GPipe 2 x B4", _config(train={"micro_batch_size": 4, "grad_accum_steps": 2},
                                      parallel={"pp": 2, "dp_shard": 1, "pp_schedule": "gpipe"}), 2),
        ("PP 2 interleaved v2 4 x B2", _config(train={"micro_batch_size": 2, "grad_accum_steps": 4},
                                               parallel={"pp": 2, "dp_shard": 1, "pp_stages_per_rank": 2,
                                                         "pp_schedule": "interleaved_1f1b"}), 2),
        ("1p SFT full, packed B8", _method("sft"), 1),
        ("1p SFT LoRA r16 B8", _method("sft", {"method": "lora", "r": 16}), 1),
        ("1p SFT QLoRA r16 B8", _method("sft", {"method": "qlora", "r": 16}), 1),
        ("1p DPO full + reference copy, 4 pairs", _method("dpo", train={"micro_batch_size": 4}), 1),
        ("1p DPO LoRA r16, 4 pairs", _method("dpo", {"method": "lora", "r": 16}, {"micro_batch_size": 4}), 1),
        ("1p reward model full, 4 pairs", _method("reward", train={"micro_batch_size": 4}), 1),
    ]


def compare(config: dict, world_size: int, steps: int = 3) -> tuple[int, int]:
    """(estimated peak bytes of the busiest rank, measured peak bytes of the busiest rank)."""
    from lmforge.config.schema import Config
    from lmforge.tools.estimate import estimate

    est = estimate(Config.model_validate(config), world_size, "cpu")
    return est.peak, max(measure(config, world_size, steps))


def _warm_up(world_size: int) -> None:
    """The first forward, backward and optimizer step of a process allocate lasting runtime state
    (thread pools, kernel caches); run them on a tiny model before the baseline is taken."""
    import torch

    from lmforge.config.schema import ModelConfig
    from lmforge.models.transformer import build_model
    from lmforge.parallel.checkpointing import apply_activation_checkpointing

    m = build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=16))
    opt = torch.optim.AdamW(m.parameters(), fused=True)
    m(torch.zeros(1, 16, dtype=torch.long)).float().mean().backward()
    opt.step()
    # A checkpointed block's first forward and recompute set up torch.utils.checkpoint's machinery.
    c = build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=16))
    apply_activation_checkpointing(c, "full")
    c(torch.zeros(1, 16, dtype=torch.long)).float().mean().backward()
    if world_size > 1:
        import torch.distributed as dist

        t = torch.ones(1 << 14)
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty(world_size * t.numel()), t)
        dist.barrier()
    del m, opt, c


def _worker(spec_path: str, out_dir: str) -> None:
    import gc

    import torch

    from lmforge.config.schema import Config
    from lmforge.engine.objectives import build_objective
    from lmforge.engine.precision import Precision
    from lmforge.optim.builder import build_optimizer
    from lmforge.parallel.api import parallelize
    from lmforge.parallel.dims import ParallelDims
    from lmforge.parallel.process_group import init_distributed

    spec = json.loads(Path(spec_path).read_text())
    cfg = Config.model_validate(spec["config"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    init_distributed(cfg.parallel.timeout_s, cpu, 1)
    dims = ParallelDims.resolve(cfg.parallel, world_size, cfg.model, cfg.train.grad_accum_steps)
    if world_size > 1:
        dims.build_mesh("cpu")
    tc = cfg.train
    g = torch.Generator().manual_seed(1234 + dims.dp_rank if world_size > 1 else 1234)
    batches = [[_batch(cfg, g) for _ in range(tc.grad_accum_steps)] for _ in range(spec["steps"])]
    objective = build_objective(cfg)
    _warm_up(world_size)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    torch.manual_seed(0)
    pm = parallelize(_method_model(cfg, objective), cfg, dims, "fp32", objective)
    optimizer = pm.wrap_optimizer(build_optimizer(pm.model, cfg.optim))
    precision = Precision("fp32", cpu)
    for step_batches in batches:
        pm.step(step_batches, optimizer, precision, grad_clip=tc.grad_clip)
    peak = _status("VmHWM") - base
    (Path(out_dir) / f"peak_{rank}.json").write_text(json.dumps({"peak": peak, "base": base}))
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def _batch(cfg, g):
    """One micro-batch of random tokens as the objective takes it; every position a target (the
    estimate's worst case): SFT rows of two packed conversations, preference rows ending with their
    completion (micro_batch_size pairs: chosen rows, then rejected)."""
    import torch

    from lmforge.data.batch import IGNORE_INDEX, ChatBatch, PreferenceBatch, TokenBatch

    facts, B, T, V = method_facts(cfg), cfg.train.micro_batch_size, cfg.seq_len, cfg.model.vocab_size
    rows = facts.batch_rows * B
    ids, targets = (torch.randint(0, V, (rows, T), generator=g) for _ in range(2))
    if facts.data == "chat":
        seg = torch.zeros(rows, T, dtype=torch.long)
        seg[:, T // 2:] = 1
        pos = torch.cat([torch.arange(T // 2), torch.arange(T - T // 2)]).expand(rows, T).contiguous()
        return ChatBatch(ids, targets, pos, seg, real_tokens=rows * T)
    if facts.batch_rows == 2:  # pairs
        targets[:, -1] = IGNORE_INDEX
        return PreferenceBatch(ids, targets, real_tokens=rows * T)
    return TokenBatch(ids, targets)


def _method_model(cfg, objective):
    """The model as the assembly sets it up for the method (assembly/build.py): a reward model's score
    head, the finetune section (adapters, NF4 base), the reference model of a preference loss."""
    from lmforge.assembly.methods.reference import adapters_off, logps_of, summed
    from lmforge.finetune.lora import lora_layers
    from lmforge.finetune.setup import apply_finetune
    from lmforge.models.transformer import add_head, build_model

    model = build_model(cfg.model)
    facts = method_facts(cfg)
    score = facts.scalar_head == "score"
    if score:
        add_head(model, "score")
    if cfg.finetune.method != "full" or facts.chat:
        apply_finetune(model, cfg.finetune, seed=cfg.run.seed)
        if score:
            model.score.requires_grad_(True)
    if "reference" in facts.extra_models:  # (the estimate models no rl: a preference loss's reference)
        if lora_layers(model):
            objective.reference = summed(adapters_off(model))
        else:  # a frozen copy of the starting weights
            frozen = build_model(cfg.model)
            frozen.load_state_dict(model.state_dict())
            objective.reference = summed(logps_of(frozen.requires_grad_(False)))
    return model


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
