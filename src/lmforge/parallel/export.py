"""Consolidated export: the whole model's weights, gathered from every rank's shards and stages,
in one safetensors file written by rank 0."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lmforge.parallel.dims import ParallelDims


def full_state_dict(model: nn.Module, dims: ParallelDims | None = None) -> dict[str, torch.Tensor]:
    """FQN -> full CPU tensor on global rank 0 ({} elsewhere). Collective: every rank calls it.

    FSDP / TP shards are gathered by DTensor; pipeline stages then travel to rank 0 over the pp
    group of the ranks at dp 0 / tp 0 (their stage dicts are whole after the gather).
    """
    if dims is None or dims.pp == 1:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if not dist.is_initialized() or dist.get_rank() == 0 else {}
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if dims.dp_rank != 0 or dims.tp_rank != 0:
        return {}
    sd = {k: v.detach().cpu() for k, v in sd.items()}
    parts: list[dict] | None = [{} for _ in range(dims.pp)] if dims.pp_rank == 0 else None
    dist.gather_object(sd, parts, group=dims.mesh["pp"].get_group(), group_dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts is not None else {}


def save_consolidated(model: nn.Module, path: Path, dims: ParallelDims | None = None) -> Path | None:
    """Write the full weights to `path` (safetensors) on rank 0; returns the path there, None elsewhere."""
    from safetensors.torch import save_file

    sd = full_state_dict(model, dims)
    if not sd:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path
