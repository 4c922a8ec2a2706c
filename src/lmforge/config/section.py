"""The base of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Seeds reach numpy's generators, which take at most 2**32 - 1 (torch and random take more).
SEED_MAX = 2**32 - 1


class Section(BaseModel):
    """A config section: unknown keys are errors, and a validated section is immutable. A config is
    resolved once (lmforge.assembly) into a new tree; nothing edits one in place afterwards.

    No key takes NaN or infinity (`.nan`, `.inf`, 1e999): every number is a setting whose "no limit"
    is spelled null, so a non-finite value can only be a mistake, and one that a range check (ge / le)
    would let through (inf >= 0) or silently fail (NaN compares false)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=(), allow_inf_nan=False)
