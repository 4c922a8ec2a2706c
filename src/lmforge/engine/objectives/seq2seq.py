"""Sequence-to-sequence fine-tuning of an encoder-decoder (model.arch=t5) on input -> target records
(data/seq2seq_data.py): teacher forcing, the decoder reading the targets shifted right behind
model.decoder_start_token_id (T5's _shift_right, as transformers' T5ForConditionalGeneration does with
`labels=`), the encoder reading the padded inputs under their attention mask. The loss is the
cross-entropy summed over the target tokens (padding, IGNORE_INDEX, costs nothing); the step divides it by
the step's target count, so the mean equals transformers' loss of the same batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.batch import IGNORE_INDEX
from lmforge.data.seq2seq import Seq2SeqBatch
from lmforge.engine.objectives.base import Objective, ObjectiveOutput
from lmforge.errors import ConfigError


class Seq2Seq(Objective):
    name = "seq2seq"
    batch_type = Seq2SeqBatch
    supports_pipeline = False  # the encoder-decoder has no pipeline stages

    def __init__(self, decoder_start: int = 0) -> None:
        self.decoder_start = decoder_start

    @classmethod
    def from_config(cls, cfg: Any) -> Seq2Seq:
        return cls(cfg.model.decoder_start_token_id)

    def num_targets(self, batch: Seq2SeqBatch) -> int:
        return batch.target_count()  # counted on the host before the batch moved

    def target_ids(self, batch: Seq2SeqBatch) -> torch.Tensor:
        return batch.targets[batch.targets != IGNORE_INDEX]  # the target text's tokens: bits per byte

    def __call__(self, model: nn.Module, batch: Seq2SeqBatch) -> ObjectiveOutput:
        dec = batch.decoder_inputs(self.decoder_start)
        logits = model(batch.input_ids, dec, attention_mask=batch.attention_mask)  # (B, L, V)
        flat, targets = logits.flatten(0, 1), batch.targets.flatten()
        loss = F.cross_entropy(flat.float(), targets, reduction="sum", ignore_index=IGNORE_INDEX)
        correct = (flat.detach().argmax(-1) == targets).sum().float()  # padding never equals -100
        return ObjectiveOutput(loss, {"accuracy": correct})

    def check_model(self, model: nn.Module) -> None:
        if getattr(getattr(model, "cfg", None), "arch", None) != "t5":
            raise ConfigError("objective seq2seq fine-tunes an encoder-decoder: set model.arch=t5 (or "
                              "model.init_from a T5 run or Hugging Face T5 dir)")
