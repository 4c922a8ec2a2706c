"""Renamed lmforge.eval.open_run (it opens a trained run, checkpoint or Hugging Face dir for `lmforge eval`
and `lmforge generate`; `entry` said nothing of that). This old import path stays for one release and is
the new module itself, so `lmforge.eval.entry.evaluate` is `lmforge.eval.open_run.evaluate` and patching
one patches the other."""

import sys
import warnings

from lmforge.eval import open_run

warnings.warn("lmforge.eval.entry is renamed lmforge.eval.open_run; import that instead (the old path goes "
              "after this release)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = open_run
