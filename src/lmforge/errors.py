"""Errors a user can cause. Anything raised as an `LmforgeError` is printed as one clear message
(exit status 2, no traceback); everything else is a bug and keeps its traceback."""

from __future__ import annotations


class LmforgeError(ValueError):
    """A user error: bad config, bad input data, a run dir in the wrong state, a full disk."""


class ConfigError(LmforgeError):
    """The config tree (YAML file or `--set` override) is invalid."""


class DataError(LmforgeError):
    """Input text or prepared shards are missing, empty or malformed."""


class CheckpointError(LmforgeError):
    """A checkpoint cannot be written or does not match the run being resumed."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint is readable but belongs to a model of another shape."""


class LmforgeDeprecationWarning(UserWarning):
    """A config key or call that still works but has a new form (the CLI prints it as one line)."""
