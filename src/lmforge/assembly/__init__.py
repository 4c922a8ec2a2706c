"""The one place a run is assembled from its config (`build_run`); everything that trains,
evaluates, samples or measures a model gets its parts from here."""

from lmforge.assembly.build import Run, build_run, check_layout, resolve_vocab_size

__all__ = ["Run", "build_run", "check_layout", "resolve_vocab_size"]
