"""The step interface, and the table from config `step` names to the modules implementing them.

A *map step* looks at one document at a time (`apply`): filters, normalisers, redactors. It must be
deterministic and hold no state across documents, so shards can run in any order on any worker.
Deduplication needs the whole corpus and is orchestrated by the runner in global stages instead
(see `dedup.py`); its config entries are not map steps.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from lmforge.data.curate.doc import Doc

# config `step` name -> module defining a MapStep subclass called `Step`; imported on demand.
MAP_STEPS = {
    "normalize": "lmforge.data.curate.steps.normalize",
    "gopher_quality": "lmforge.data.curate.steps.gopher",
    "c4_quality": "lmforge.data.curate.steps.c4",
    "repetition": "lmforge.data.curate.steps.repetition",
    "harmful": "lmforge.data.curate.steps.harmful",
    "language": "lmforge.data.curate.steps.language",
    "length": "lmforge.data.curate.steps.length",
    "pii": "lmforge.data.curate.steps.pii",
    "decontaminate": "lmforge.data.curate.steps.decontaminate",
}
GLOBAL_STEPS = ("exact_dedup", "minhash_dedup")


class MapStep(ABC):
    """A per-document step, built from its config entry."""

    name: ClassVar[str]

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    @abstractmethod
    def apply(self, doc: Doc) -> tuple[Doc | None, str | None]:
        """(the document, possibly changed, or None if dropped; the reason when dropped)."""

    def score(self, doc: Doc) -> dict[str, float]:
        """Quality metrics this step computes for `doc` (used for the strictness curve); {} if none."""
        return {}

    def describe(self) -> dict:
        """What this step will match or use beyond its config, for the run's output and the report (the
        `harmful` step: which block lists and how many entries), with a one-line "summary"; {} if nothing
        to add."""
        return {}

    def take_counts(self) -> dict[str, int]:
        """Step-specific counters since the last call (e.g. PII matches by type), then reset them."""
        return {}


def build_map_step(cfg: Any) -> MapStep:
    """The step object for one `curate.steps` entry (not for the global dedup steps)."""
    return importlib.import_module(MAP_STEPS[cfg.step]).Step(cfg)
