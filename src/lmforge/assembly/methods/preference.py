"""Preference setup (objectives dpo and reward, over preference pairs or KTO's unpaired records): the
reference model (or its log-probs computed ahead), the pair loaders, the reference to evaluate with."""

from __future__ import annotations

import numpy as np
import torch

from lmforge.assembly.methods.base import MethodSetup, SetupContext
from lmforge.assembly.methods.reference import eval_reference, reference, summed
from lmforge.config.methods import method_facts
from lmforge.config.schema import Config
from lmforge.engine.objectives.preference import Preference
from lmforge.engine.objectives.reward import RewardModel
from lmforge.errors import ConfigError


class PreferenceSetup(MethodSetup):
    names = (Preference.name, RewardModel.name)

    def attach(self, objective, ctx: SetupContext):
        if not isinstance(objective, Preference) or not objective.needs_reference:
            return None
        if objective.reference is not None:  # handed over in Python
            return None
        objective.reference = summed(reference(ctx.model, ctx.cfg, ctx.dims, ctx.device, ctx.data,
                                               ctx.source_vocab, ctx.say,
                                               "a reference-free loss (preference.loss=simpo or orpo)"))
        if ctx.cfg.preference.precompute_reference:
            return precompute_reference(objective, ctx.cfg, ctx.data, ctx.say)
        return None

    def attach_eval(self, run, data) -> None:
        if isinstance(run.objective, Preference) and run.objective.needs_reference:
            run.objective.reference = summed(eval_reference(run.model, run.cfg, run.device, data))

    def loader(self, cfg: Config, data, split: str, batch_size: int, **kw):
        """PreferenceLoader (batch_size pairs, their margins); UnpairedLoader for KTO's records."""
        from lmforge.data.chat_loader import PreferenceLoader, UnpairedLoader

        if method_facts(cfg).data == "unpaired":
            labels = [bool(i.get("label")) for i in data.info(split) or []]
            return UnpairedLoader(data.split(split), labels, cfg.seq_len, batch_size, **kw)
        margins = [i.get("margin") for i in data.info(split) or []] or None
        return PreferenceLoader(data.split(split), cfg.seq_len, batch_size, margins=margins, **kw)


@torch.no_grad()
def precompute_reference(objective: Preference, cfg: Config, data, say) -> dict[str, np.ndarray]:
    """The reference model's summed completion log-probs of every pair of each split, (pairs, 2) as
    (chosen, rejected), computed once in batches of train.micro_batch_size pairs; the objective then
    lets the reference go (a frozen copy is freed)."""
    from lmforge.data.chat_loader import PreferenceLoader

    if cfg.preference.loss == "kto":
        raise ConfigError("preference.precompute_reference does not apply to loss kto: its reference point "
                          "comes from pairs of examples within each batch; set it to false")
    out = {}
    for name in ("train", "val"):
        split = data.split(name)
        if not len(split):
            continue
        loader = PreferenceLoader(split, cfg.seq_len, cfg.train.micro_batch_size, shuffle=False,
                                  drop_last=False, pad_id=data.tokenizer.eos_id)
        parts = []
        for batch in loader.iter_eval_batches():
            ref = objective.reference(batch).float().cpu()
            parts.append(torch.stack([ref[: batch.pairs], ref[batch.pairs :]], 1))
        out[name] = torch.cat(parts).numpy()
    objective.reference = None
    say(f"reference log-probs computed ahead for {sum(len(v) for v in out.values()):,} pairs; the reference "
        "model is freed")
    return out
