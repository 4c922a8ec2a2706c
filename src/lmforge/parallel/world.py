"""Who am I in the job: rank, world size, device. One rank speaks (prints, logs, saves).

Read from the environment torchrun sets, so single-process runs need no process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> World:
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        )


def resolve_device(name: str, world: World) -> torch.device:
    """'auto' -> this rank's GPU if there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            from lmforge.errors import ConfigError

            raise ConfigError("train.device: 'cuda' was asked for but no CUDA device is available; "
                              "use 'auto' or 'cpu'")
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")
