"""Model definitions: the transformer decoder, its shared blocks, presets and FLOP counts.

The public names load lazily, so that importing `lmforge.models.presets` (which the config schema
does) never pulls in torch: config validation and data curation workers stay light.
"""

__all__ = ["KVCache", "Transformer", "build_model"]


def __getattr__(name: str):
    if name == "KVCache":
        from lmforge.models.common.attention import KVCache

        return KVCache
    if name in ("Transformer", "build_model"):
        from lmforge.models import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'lmforge.models' has no attribute {name!r}")
