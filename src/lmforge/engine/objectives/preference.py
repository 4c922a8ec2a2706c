"""Preference optimisation over `PreferenceBatch`es: the DPO family, SimPO, ORPO (losses in
engine/preference_loss.py, equal to TRL's).

One forward of the policy over the chosen and rejected rows together gives each completion's summed
log-probability; the reference model's come from the batch (computed ahead) or from `reference`, a
callable the assembly supplies (the model with its adapters disabled for LoRA, a frozen copy for full
fine-tuning), run without gradients. The loss is summed over pairs and the step divides by the pairs
of the whole step, so accumulation and data parallelism equal one big batch, as for every objective.

Metrics (sums over pairs, reported as means per pair): the implicit rewards of the chosen and
rejected completions, their margin, the reward accuracy (chosen reward > rejected), the log-prob
accuracy (the policy gives the chosen completion the higher log-probability: meaningful for any
model, trained or not; `ref_logp_accuracy` is the reference model's) and the policy's mean
completion log-probs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from lmforge.data.batch import PreferenceBatch, UnpairedBatch
from lmforge.engine.loss import logits_of
from lmforge.engine.objectives.base import Objective, ObjectiveOutput
from lmforge.engine.preference_loss import (
    PAIR_LOSSES,
    REFERENCE_FREE,
    kto_losses,
    kto_reference_point,
    pair_losses,
    sequence_logps,
)
from lmforge.errors import ConfigError

Reference = Callable[[PreferenceBatch], torch.Tensor]  # batch -> (2P,) summed completion log-probs


def completion_logps(model: nn.Module, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion log-probs (2P,), completion token counts (2P,)) of `model` on `batch`."""
    return sequence_logps(logits_of(model(batch.input_ids)), batch.targets)


class Preference(Objective):
    name = "dpo"
    batch_type = PreferenceBatch

    def __init__(self, loss: str = "sigmoid", beta: float = 0.1, label_smoothing: float = 0.0,
                 simpo_gamma: float = 0.5, sft_weight: float = 0.0,
                 reference: Reference | None = None) -> None:
        if loss not in (*PAIR_LOSSES, "kto"):
            raise ConfigError(f"preference loss {loss!r} is not one of {', '.join(PAIR_LOSSES)}")
        self.loss, self.beta = loss, beta
        self.label_smoothing, self.simpo_gamma, self.sft_weight = label_smoothing, simpo_gamma, sft_weight
        self.reference = reference

    @classmethod
    def from_config(cls, cfg) -> Preference:
        p = cfg.preference
        if cfg.train.loss_chunk_tokens:
            raise ConfigError("train.loss_chunk_tokens is not implemented for objective dpo (its loss needs "
                              "each sequence's log-probabilities); set it to 0")
        if p.loss == "kto":
            return KTO(beta=p.beta, desirable_weight=p.desirable_weight,
                       undesirable_weight=p.undesirable_weight)
        return cls(loss=p.loss, beta=p.beta, label_smoothing=p.label_smoothing, simpo_gamma=p.simpo_gamma,
                   sft_weight=p.sft_weight)

    def batch_of(self, raw) -> PreferenceBatch:
        """The batch, with the reference model's log-probs attached when the loss needs them: computed
        here, before the (possibly compiled) policy forward, without gradients."""
        batch = super().batch_of(raw)
        if self.needs_reference and batch.ref_logps is None and self.reference is not None:
            batch = dataclasses.replace(batch, ref_logps=self.reference_logps(batch))
        return batch

    @property
    def needs_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE

    def num_targets(self, batch: PreferenceBatch) -> int:
        return batch.pairs

    def reference_logps(self, batch: PreferenceBatch) -> torch.Tensor:
        if batch.ref_logps is not None:
            return batch.ref_logps
        if self.reference is None:
            raise ConfigError(f"preference loss {self.loss} compares with a reference model, and neither the "
                              "batch nor the objective has one; the assembly gives one (or use simpo / orpo)")
        with torch.no_grad():
            return self.reference(batch).detach()

    def __call__(self, model: nn.Module, batch: PreferenceBatch) -> ObjectiveOutput:
        logits = logits_of(model(batch.input_ids))
        logps, counts = sequence_logps(logits, batch.targets)
        p = batch.pairs
        ref_c = ref_r = nll = None
        if self.needs_reference:
            ref = self.reference_logps(batch)
            ref_c, ref_r = ref[:p], ref[p:]
        if self.loss == "orpo" or self.sft_weight:
            nll = -logps[:p] / counts[:p].clamp(min=1).to(logps.dtype)  # (P,) token mean per chosen
        out = pair_losses(self.loss, logps[:p], logps[p:], ref_c, ref_r, chosen_tokens=counts[:p],
                          rejected_tokens=counts[p:], beta=self.beta, label_smoothing=self.label_smoothing,
                          simpo_gamma=self.simpo_gamma, chosen_nll=nll)
        losses = out.losses
        if self.sft_weight and self.loss != "orpo":  # RPO: the chosen answer's NLL keeps its likelihood up
            losses = losses + self.sft_weight * nll
        chosen, rejected = out.chosen_rewards, out.rejected_rewards
        metrics = {
            "reward_chosen": chosen.sum(),
            "reward_rejected": rejected.sum(),
            "reward_margin": (chosen - rejected).sum(),
            "reward_accuracy": (chosen > rejected).float().sum(),
            # the policy itself prefers the chosen completion (meaningful before any training too)
            "logp_accuracy": (logps[:p] > logps[p:]).float().sum(),
            "logp_chosen": logps[:p].detach().sum(),
            "logp_rejected": logps[p:].detach().sum(),
        }
        if ref_c is not None:  # the same for the reference model: where the policy started
            metrics["ref_logp_accuracy"] = (ref_c > ref_r).float().sum()
        return ObjectiveOutput(losses.sum(), metrics)


class KTO(Preference):
    """KTO (Ethayarajh et al. 2024) on unpaired examples (`UnpairedBatch`): objective dpo with
    preference.loss=kto. One forward covers the examples and their mismatched twins; the reference
    point z is the batch's mean policy-minus-reference log-ratio of the twins, clamped at 0 and
    detached (per micro-batch and rank; TRL averages it over the processes of a step). The loss is
    summed over examples, the step divides by the examples of the whole step (TRL's mean). Metrics:
    the rewards b (p - r) of the desirable and the undesirable examples (each a mean over its own),
    their policy log-probs, and z (`kl`, a mean over micro-batches)."""

    batch_type = UnpairedBatch

    def __init__(self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                 reference: Reference | None = None) -> None:
        super().__init__(loss="kto", beta=beta, reference=reference)
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    def num_targets(self, batch: UnpairedBatch) -> int:
        return batch.examples

    def __call__(self, model: nn.Module, batch: UnpairedBatch) -> ObjectiveOutput:
        logps, _ = sequence_logps(logits_of(model(batch.input_ids)), batch.targets)  # (2B,)
        ref = self.reference_logps(batch)
        b = batch.examples
        z = kto_reference_point(logps[b:].detach(), ref[b:])
        losses, rewards = kto_losses(logps[:b], ref[:b], batch.desirable, z, beta=self.beta,
                                     desirable_weight=self.desirable_weight,
                                     undesirable_weight=self.undesirable_weight)
        good, bad = batch.desirable, ~batch.desirable
        one = torch.ones((), device=logps.device)
        metrics = {
            "reward_desirable": rewards[good].sum(),
            "reward_undesirable": rewards[bad].sum(),
            "logp_desirable": logps[:b][good].detach().sum(),
            "logp_undesirable": logps[:b][bad].detach().sum(),
            "kl": z,
        }
        counts = {"reward_desirable": good.sum().float(), "reward_undesirable": bad.sum().float(),
                  "logp_desirable": good.sum().float(), "logp_undesirable": bad.sum().float(), "kl": one}
        return ObjectiveOutput(losses.sum(), metrics, counts)
