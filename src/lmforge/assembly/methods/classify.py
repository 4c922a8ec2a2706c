"""Classification setup (objective classify, over labelled records): its loader, and the class weights
classify.class_weights=balanced derives from the training split's labels."""

from __future__ import annotations

import json
from pathlib import Path

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


def keep_label_map(run_dir: Path, labels: list) -> None:
    """The run's label map in its run dir (labels.json), written once when it starts: a resumed run whose
    data now maps the classes otherwise is refused (its head's outputs would change meaning)."""
    from lmforge.data.labelled import LABELS_FILE
    from lmforge.errors import DataError
    from lmforge.utils.io import atomic_write_json

    path = run_dir / LABELS_FILE
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved != labels:
            raise DataError(f"{path} maps the classes as {saved[:10]}, the data now as {labels[:10]}: a "
                            "resumed classifier keeps its label map; use the data it started with or a new "
                            "run.dir")
        return
    atomic_write_json(path, labels)


class ClassifySetup(MethodSetup):
    names = (Classify.name,)

    def _weigh(self, objective, cfg: Config, data) -> None:
        if isinstance(objective, Classify) and cfg.classify.class_weights == "balanced":
            weights = balanced_weights(data.split("train").labels, cfg.classify.num_labels)
            objective.weights = torch.tensor(weights, dtype=torch.float32)

    def attach(self, objective, ctx: SetupContext):
        from lmforge.parallel.coord import on_rank0

        on_rank0(lambda: keep_label_map(Path(ctx.cfg.run.dir), ctx.data.labels))
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
