"""Sequence-to-sequence fine-tuning setup (objective seq2seq, over input -> target records): its loader of
padded encoder inputs and targets."""

from __future__ import annotations

from lmforge.assembly.methods.base import MethodSetup
from lmforge.config.schema import Config
from lmforge.engine.objectives.seq2seq import Seq2Seq


class Seq2SeqSetup(MethodSetup):
    names = (Seq2Seq.name,)

    def check_inputs(self, cfg: Config) -> None:
        """The sft section is a decoder's chat fine-tuning (a template, packing): set there, it would be
        ignored by an encoder-decoder's, which reads the seq2seq section; refused by name instead."""
        set_keys = sorted(cfg.sft.model_fields_set)
        if set_keys:
            from lmforge.errors import ConfigError

            raise ConfigError(f"objective seq2seq (`lmforge sft` of an encoder-decoder, model.arch=t5) reads "
                              f"the seq2seq section, not {', '.join(f'sft.{k}' for k in set_keys)}: records "
                              "go in seq2seq.data / seq2seq.val_data (no chat template, no packing: each "
                              "record is one padded row); remove the sft keys")

    def loader(self, cfg: Config, data, split: str, batch_size: int, **kw):
        """Seq2SeqLoader: one record per row, both sides right-padded."""
        from lmforge.data.seq2seq_data import Seq2SeqLoader

        return Seq2SeqLoader(data.split(split), cfg.seq_len, batch_size, **kw)


def objective_for_model(cfg: Config, objective: str) -> str:
    """The objective `lmforge <verb>` trains on the config's model: `sft` of an encoder-decoder
    (model.arch=t5, or model.init_from one) is seq2seq, its input -> target fine-tuning; any other as is."""
    if objective != "sft":
        return objective
    arch = cfg.model.arch
    if cfg.model.init_from and "arch" not in cfg.model.model_fields_set:
        from lmforge.checkpoint.runs import source_model_config

        arch = source_model_config(cfg.model.init_from).arch
    return Seq2Seq.name if arch == "t5" else objective
