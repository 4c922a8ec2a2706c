"""Classification setup (objective classify, over labelled records): its loader, and the class weights
classify.class_weights=balanced derives from the training split's labels."""

from __future__ import annotations

import numpy as np
import torch

from lmforge.assembly.methods.base import MethodSetup, SetupContext
from lmforge.config.schema import Config
from lmforge.engine.objectives.classify import Classify


def balanced_weights(labels: np.ndarray, num_labels: int) -> list[float]:
    """scikit-learn's compute_class_weight("balanced"): n / (num_labels x count of the class); a class the
    split does not hold gets 1 (it never weighs a loss of its own)."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_labels)
    n = counts.sum()
    return [float(n / (num_labels * c)) if c else 1.0 for c in counts]


class ClassifySetup(MethodSetup):
    names = (Classify.name,)

    def _weigh(self, objective, cfg: Config, data) -> None:
        if isinstance(objective, Classify) and cfg.classify.class_weights == "balanced":
            weights = balanced_weights(data.split("train").labels, cfg.classify.num_labels)
            objective.weights = torch.tensor(weights, dtype=torch.float32)

    def attach(self, objective, ctx: SetupContext):
        self._weigh(objective, ctx.cfg, ctx.data)
        if objective.weights is not None:
            ctx.say("class weights: " + ", ".join(f"{w:.3g}" for w in objective.weights.tolist()))
        return None

    def attach_eval(self, run, data) -> None:
        self._weigh(run.objective, run.cfg, data)

    def loader(self, cfg: Config, data, split: str, batch_size: int, **kw):
        """LabelledLoader: one example per row, right-padded."""
        from lmforge.data.labelled import LabelledLoader

        return LabelledLoader(data.split(split), cfg.seq_len, batch_size, **kw)
