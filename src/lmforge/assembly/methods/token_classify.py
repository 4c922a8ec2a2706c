"""Token-classification setup (objective tag, over tagged words): its loader, the run's tag
map kept in its run dir, and the class weights token_classify.class_weights=balanced derives from the
training split's tagged words."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lmforge.assembly.methods.base import MethodSetup, SetupContext
from lmforge.assembly.methods.classify import balanced_weights, keep_label_map
from lmforge.config.schema import Config
from lmforge.data.batch import IGNORE_INDEX
from lmforge.engine.objectives.token_classify import TokenClassify


class TokenClassifySetup(MethodSetup):
    names = (TokenClassify.name,)

    def _weigh(self, objective, cfg: Config, data) -> None:
        if cfg.token_classify.class_weights == "balanced":
            labels = np.asarray(data.split("train").labels)
            objective.weights = torch.tensor(balanced_weights(labels[labels != IGNORE_INDEX],
                                                              cfg.token_classify.num_labels),
                                             dtype=torch.float32)

    def attach(self, objective, ctx: SetupContext):
        from lmforge.parallel.coord import on_rank0

        on_rank0(lambda: keep_label_map(Path(ctx.cfg.run.dir), ctx.data.labels))
        self._weigh(objective, ctx.cfg, ctx.data)
        if objective.weights is not None:
            ctx.say("tag weights: " + ", ".join(f"{w:.3g}" for w in objective.weights.tolist()))
        return None

    def attach_eval(self, run, data) -> None:
        self._weigh(run.objective, run.cfg, data)

    def loader(self, cfg: Config, data, split: str, batch_size: int, **kw):
        """TaggedLoader: one sentence per row, right-padded."""
        from lmforge.data.labelled_tokens import TaggedLoader

        return TaggedLoader(data.split(split), cfg.seq_len, batch_size, **kw)
