"""Per-family parts of the GGUF writer (export/gguf.py): one module per group of Hugging Face
model_types, each providing

- `ARCHES`: {model_type: llama.cpp architecture name};
- `check(cfg)`: refuse (LmforgeError) what llama.cpp's architecture cannot express;
- `metadata(ctx)`: the architecture's metadata keys (the writer adds name, vocab, file type, tokenizer);
- `plan(ctx)`: the tensors, as `Planned` (GGUF name, shape, a loader, a quantization role).

A new family is one new module here; `family()` finds it by its model_type."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from types import ModuleType

from lmforge.errors import LmforgeError

_SHARED = {"common"}


@cache
def families() -> dict[str, ModuleType]:
    """model_type -> the module that writes it."""
    out: dict[str, ModuleType] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in _SHARED:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for model_type in module.ARCHES:
            if model_type in out:
                raise RuntimeError(f"GGUF model_type {model_type!r} claimed by {out[model_type].__name__} "
                                   f"and {module.__name__}")
            out[model_type] = module
    return out


def family(model_type: str | None) -> ModuleType:
    found = families().get(model_type)  # type: ignore[arg-type]
    if found is None:
        raise LmforgeError(f"GGUF export does not support model_type {model_type!r}; supported: "
                           f"{', '.join(sorted(families()))} (use --format hf for the others)")
    return found


def arch_of(model_type: str) -> str:
    return family(model_type).ARCHES[model_type]
