"""The error of a task file (or its documents) that cannot be evaluated."""

from __future__ import annotations

from lmforge.errors import LmforgeError


class TaskError(LmforgeError):
    """A task file (or its documents) that cannot be evaluated."""

