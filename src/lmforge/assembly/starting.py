"""The model a run starts from: lmforge's Transformer with model.init_from's weights, its vocabulary grown
for a chat template's new tokens. The assembly builds the trained model with it, and the method setups
that keep a frozen copy of the starting weights (a reference model) build theirs the same way."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.checkpoint.runs import load_weights
from lmforge.config.schema import Config


def starting_model(cfg: Config, device: torch.device, chat_data, source_vocab: int | None,
                   load: bool = True) -> nn.Module:
    """lmforge's Transformer as fine-tuning starts it: model.init_from's weights (when `load`), the
    vocabulary grown for a chat template's new tokens and their rows initialised (`chat_data`: the
    prepared chat data, None for pretraining)."""
    from lmforge.models import build_model
    from lmforge.models.resize import init_token_rows, resize_vocab

    grow = chat_data is not None and source_vocab is not None and cfg.model.vocab_size > source_vocab
    # a reward model's or PPO's scalar head is added afterwards: the weights it starts from have none
    arch = cfg.model.model_copy(update={"score_head": False, "value_head": False})
    model = build_model(arch.model_copy(update={"vocab_size": source_vocab}) if grow else arch, device=device)
    if load and cfg.model.init_from:
        load_weights(cfg.model.init_from, model)
    if grow:
        resize_vocab(model, cfg.model.vocab_size)
    if chat_data is not None and load and cfg.model.init_from:
        init_token_rows(model, chat_data.meta["added_tokens"], chat_data.meta["base_vocab"])
    return model
