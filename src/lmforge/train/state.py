"""The loop's small Stateful parts besides the clock (train/clock.py): where the run is (`Progress`) and
what callbacks and the stability machinery ask of it (`Control`). The Trainer keeps them in its `states`
dict; the checkpoint manager saves and restores them as it does every other part."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Progress:
    """Where the run is: optimizer steps taken, tokens seen (all ranks), steps whose update was skipped."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])
        self.skipped_steps = int(sd.get("skipped_steps", 0))


@dataclass
class Control:
    """What callbacks and the stability machinery ask of the loop: an lr scale (saved, so a resumed
    run keeps it) and a stop request (not saved: it ends this process's loop)."""

    lr_scale: float = 1.0
    stop: tuple[str | None, dict[str, Any]] | None = None

    def state_dict(self) -> dict:
        return {"lr_scale": self.lr_scale}

    def load_state_dict(self, sd: dict) -> None:
        self.lr_scale = float(sd["lr_scale"])
