"""Supervised fine-tuning setup (objective sft, over conversations): its loader."""

from __future__ import annotations

from lmforge.assembly.methods.base import MethodSetup
from lmforge.config.schema import Config
from lmforge.engine.objectives.sft import SFT


class SFTSetup(MethodSetup):
    names = (SFT.name,)

    def loader(self, cfg: Config, data, split: str, batch_size: int, **kw):
        """ChatLoader: conversations, packed per sft.packing."""
        from lmforge.data.chat_loader import ChatLoader

        return ChatLoader(data.split(split), cfg.seq_len, batch_size, packing=cfg.sft.packing, **kw)
