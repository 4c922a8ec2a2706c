"""Map steps, one per file; each module defines `Step(MapStep)` (see `lmforge.data.curate.step`)."""
