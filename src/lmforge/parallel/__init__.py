"""Distributed training applied from outside the model (models/ never imports this package).

    world.py            who am I (rank, world size) from torchrun's environment
    process_group.py    process group start / clean shutdown, the host-side (gloo) groups
    dims.py             parallel.* -> checked degrees -> DeviceMesh (pp, dp_replicate, dp_shard, tp)
    api.py              parallelize(model, cfg, dims) -> ParallelModel (.model, .step, .wrap_optimizer)
    tensor_parallel.py  TP / sequence parallelism plans
    checkpointing.py    activation checkpointing per block
    data_parallel.py    DDP, FSDP2 (ZeRO-2/3, HSDP), ZeRO-1
    pipeline.py         stages, schedules, the pipelined optimizer step
    comm.py             the distributed Comm of the shared train step
    export.py           consolidated safetensors export

The names below load lazily: the trainer imports world / checkpointing without paying for
torch.distributed's parallel modules.
"""

__all__ = ["ParallelDims", "ParallelModel", "init_distributed", "parallelize", "shutdown"]


def __getattr__(name: str):
    if name in ("parallelize", "ParallelModel"):
        from lmforge.parallel import api

        return getattr(api, name)
    if name == "ParallelDims":
        from lmforge.parallel.dims import ParallelDims

        return ParallelDims
    if name in ("init_distributed", "shutdown"):
        from lmforge.parallel import process_group

        return getattr(process_group, name)
    raise AttributeError(f"module 'lmforge.parallel' has no attribute {name!r}")
