"""RNG states as plain data, so a resumed run draws the same random numbers (dropout, sampling)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """Every RNG the training loop can touch: Python, NumPy, torch CPU and CUDA."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": list(random.getstate()[1]) + [random.getstate()[0], random.getstate()[2]],
        "numpy": {"keys": torch.from_numpy(np_state[1].copy()), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[-2], tuple(py[:-2]), py[-1]))
    npst = state["numpy"]
    np.random.set_state(("MT19937", npst["keys"].numpy(), npst["pos"], npst["has_gauss"], npst["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class RNGState:
    """Every global RNG as one Stateful part of a run (the checkpoint saves and restores it)."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng(state)
