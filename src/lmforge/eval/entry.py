"""Renamed lmforge.eval.open_run (it opens a trained run, checkpoint or Hugging Face dir for `lmforge eval`
and `lmforge generate`; `entry` said nothing of that). This old import path stays for one release and is
the new module itself: `lmforge.eval.entry.evaluate` is `lmforge.eval.open_run.evaluate`, and patching one
patches the other (lmforge.utils.renamed)."""

from lmforge.utils.renamed import renamed

renamed(__name__, "lmforge.eval.open_run")
