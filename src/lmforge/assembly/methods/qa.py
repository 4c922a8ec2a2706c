"""Question-answering setup (objective qa, over SQuAD-like records): its loader of windows."""

from __future__ import annotations

from lmforge.assembly.methods.base import MethodSetup
from lmforge.config.schema import Config
from lmforge.engine.objectives.qa import QA


class QASetup(MethodSetup):
    names = (QA.name,)

    def loader(self, cfg: Config, data, split: str, batch_size: int, **kw):
        """SpanLoader: one window per row, right-padded."""
        from lmforge.data.squad import SpanLoader

        return SpanLoader(data.split(split), cfg.seq_len, batch_size, **kw)
