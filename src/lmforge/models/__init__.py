"""Model definitions: the transformer decoder, its shared blocks, FLOP counts and the Hugging Face
adapters. The public names load lazily, so that importing `lmforge.models.flops` never pulls in torch."""

__all__ = ["KVCache", "Transformer", "build_model"]


def __getattr__(name: str):
    if name == "KVCache":
        from lmforge.models.common.attention import KVCache

        return KVCache
    if name in ("Transformer", "build_model"):
        from lmforge.models import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'lmforge.models' has no attribute {name!r}")
