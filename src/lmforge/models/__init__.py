"""Model definitions: the transformer decoder, its shared blocks, presets and FLOP counts."""

from lmforge.models.common.attention import KVCache
from lmforge.models.transformer import Transformer, build_model

__all__ = ["KVCache", "Transformer", "build_model"]
