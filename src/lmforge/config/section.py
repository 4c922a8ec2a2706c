"""The base of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, and a validated section is immutable. A config is
    resolved once (lmforge.assembly) into a new tree; nothing edits one in place afterwards."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())
