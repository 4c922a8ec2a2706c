"""Linear projections of one input computed together where the layers offer it.

`project(x, (wq, wk, wv))` is `[wq(x), wk(x), wv(x)]`. A layer type may define a static method
`project_group(x, layers)` that computes several of its layers on the same input in one piece (fewer
passes over x: LoRA adapters stack their A matrices, finetune/lora.py) and returns their outputs, or
None where it does not apply (then each layer runs on its own). Plain nn.Linear layers have no such
method: models without adapters compute exactly what they computed before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def project(x: torch.Tensor, layers: Sequence[nn.Module]) -> list[torch.Tensor]:
    """[layer(x) for layer in layers], through the layers' type's `project_group` where it applies."""
    kind = type(layers[0])
    group = getattr(kind, "project_group", None)
    if group is not None and all(type(m) is kind for m in layers[1:]):
        out = group(x, layers)
        if out is not None:
            return list(out)
    return [m(x) for m in layers]
