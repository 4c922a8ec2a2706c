"""A document travelling through the pipeline, and the per-step accounting of what happened to it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Doc:
    """One document. `id` is the input's own id field, else `<source path>:<record number>`."""

    id: str
    text: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepStats:
    """What one step did over a set of documents: counts, reasons, examples, PII counts.

    Stats of the same step from different workers/shards merge with `merge` (all fields add up;
    examples are capped), so the report is the same however the work was split.
    """

    name: str
    docs_in: int = 0
    docs_out: int = 0
    chars_in: int = 0
    chars_out: int = 0
    changed: int = 0  # documents kept but modified (normalised, redacted, lines removed)
    reasons: Counter = field(default_factory=Counter)  # removal reason -> count
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> snippets
    counts: Counter = field(default_factory=Counter)  # step-specific counts, e.g. PII type -> matches
    max_examples: int = 3

    def record(self, before: Doc, after: Doc | None, reason: str | None = None) -> None:
        """Account for one document: `after` is None when dropped (then `reason` says why)."""
        self.docs_in += 1
        self.chars_in += len(before.text)
        if after is None:
            why = reason or "dropped"
            self.reasons[why] += 1
            ex = self.examples.setdefault(why, [])
            if len(ex) < self.max_examples:
                ex.append(before.text[:300])
            return
        self.docs_out += 1
        self.chars_out += len(after.text)
        if after.text != before.text:
            self.changed += 1

    def merge(self, other: StepStats) -> None:
        assert other.name == self.name
        self.docs_in += other.docs_in
        self.docs_out += other.docs_out
        self.chars_in += other.chars_in
        self.chars_out += other.chars_out
        self.changed += other.changed
        self.reasons.update(other.reasons)
        self.counts.update(other.counts)
        for reason, ex in other.examples.items():
            mine = self.examples.setdefault(reason, [])
            mine.extend(ex[: max(0, self.max_examples - len(mine))])

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "docs_in": self.docs_in, "docs_out": self.docs_out,
            "chars_in": self.chars_in, "chars_out": self.chars_out, "changed": self.changed,
            "reasons": dict(self.reasons), "examples": self.examples, "counts": dict(self.counts),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], max_examples: int = 3) -> StepStats:
        return cls(d["name"], d["docs_in"], d["docs_out"], d["chars_in"], d["chars_out"], d["changed"],
                   Counter(d["reasons"]), {k: list(v) for k, v in d["examples"].items()},
                   Counter(d["counts"]), max_examples)
