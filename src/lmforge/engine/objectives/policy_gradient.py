"""Reinforcement learning on sampled completions (objective rl): GRPO and RLOO, their losses in
engine/policy_loss.py (equal to TRL's).

The loader hands out prompts (`PromptBatch`); `batch_of` turns each into a `RolloutBatch` through
`rollout`, a callable the assembly supplies (finetune/rollout.py: sample group_size completions per
prompt with the current weights through the KV cache, score them, compute advantages and the
reference model's log-probs). The step calls `batch_of` for every micro-batch before the first
forward, so all completions of a step come from the weights before its update (on-policy; the
sampling policy is the trained one, so the probability ratio is 1 and `old_logps` is the policy's
own log-probs, detached, as in TRL with num_iterations=1).

With `iterations` (rl.iterations, TRL's num_iterations, the GRPO paper's mu) > 1, a step's sampled
batches train that many consecutive steps: the `ReplayBuffer` keeps them (with their rewards,
advantages, reference and sampling-time log-probs) and the Trainer takes them from it instead of
drawing prompts from the loader until they are used up, so an epoch still samples every prompt once.
The first update's ratio is 1 (up to the sampling forward's rounding); the later ones clip against
the sampling policy, as TRL's GRPOTrainer does (and PPO with epochs).

The loss is summed as `rl.loss_aggregation` says and the step divides by its count over the whole
step (tokens or sequences), so accumulation and data parallelism equal one big batch. Metrics:
reward (and each reward function's) per completion, `kl` to the reference per token, completion
length, the clipped fraction of tokens and the fraction of groups with different rewards (the others
teach nothing), and with iterations > 1 `iteration`, which update of its sampled batch the step was;
a greedy evaluation pass reports the same rewards for one reply per prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.batch import PromptBatch, RolloutBatch
from lmforge.engine.loss import logits_of
from lmforge.engine.objectives.base import Objective, ObjectiveOutput
from lmforge.engine.policy_loss import (
    AGGREGATIONS,
    aggregate,
    aggregate_count,
    kl_estimate,
    policy_token_losses,
    sequence_losses,
    value_losses,
)
from lmforge.engine.preference_loss import token_logps
from lmforge.errors import ConfigError

Rollout = Callable[[PromptBatch], RolloutBatch]


class PolicyGradient(Objective):
    name = "rl"
    batch_type = RolloutBatch

    def __init__(self, algorithm: str = "grpo", aggregation: str = "token-mean", clip_eps: float = 0.2,
                 clip_eps_high: float | None = None, beta: float = 0.0, kl: str = "k3",
                 norm_length: int | None = None, rollout: Rollout | None = None, vf_coef: float = 0.1,
                 cliprange_value: float | None = 0.2, iterations: int = 1) -> None:
        if algorithm not in ("grpo", "rloo", "ppo"):
            raise ConfigError(f"rl.algorithm {algorithm!r} is not one of grpo, rloo, ppo")
        self.vf_coef, self.cliprange_value = vf_coef, cliprange_value
        if aggregation not in AGGREGATIONS:
            raise ConfigError(f"rl.loss_aggregation {aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
        self.algorithm, self.aggregation = algorithm, aggregation
        self.clip_eps, self.clip_eps_high, self.beta, self.kl = clip_eps, clip_eps_high, beta, kl
        self.norm_length = norm_length
        self.rollout = rollout
        if iterations < 1:
            raise ConfigError(f"rl.iterations={iterations}: a sampled batch trains at least one update")
        self.iterations = iterations
        self.replay = ReplayBuffer(iterations) if iterations > 1 else None

    @classmethod
    def from_config(cls, cfg) -> PolicyGradient:
        r = cfg.rl
        if cfg.train.loss_chunk_tokens:
            raise ConfigError("train.loss_chunk_tokens is not implemented for objective rl (its loss needs "
                              "each token's log-probability); set it to 0")
        if r.iterations > 1 and cfg.train.batch_warmup_tokens:
            # A replayed step trains the sampled batch's micro-batches, not the ramp's count for that step.
            raise ConfigError(f"rl.iterations={r.iterations} trains each sampled batch's micro-batches "
                              "again on the next steps, which a batch-size ramp (train.batch_warmup_tokens="
                              f"{cfg.train.batch_warmup_tokens}) would resize; set "
                              "train.batch_warmup_tokens=0 or rl.iterations=1")
        return cls(algorithm=r.algorithm, aggregation=r.loss_aggregation, clip_eps=r.clip_eps,
                   clip_eps_high=r.clip_eps_high, beta=r.beta, kl=r.kl_estimator,
                   norm_length=r.max_new_tokens, vf_coef=r.vf_coef, cliprange_value=r.cliprange_value,
                   iterations=r.iterations)

    def check_model(self, model: nn.Module) -> None:
        if self.algorithm == "ppo" and not isinstance(getattr(model, "value", None), nn.Module):
            raise ConfigError("rl.algorithm=ppo needs a model with a value head (model.value_head: true; the "
                              "assembly adds one to lmforge's Transformer)")

    def batch_of(self, raw) -> RolloutBatch:
        """Prompts become scored completions here (before the compiled forward, without gradients)."""
        if isinstance(raw, PromptBatch):
            if self.rollout is None:
                raise ConfigError("objective rl samples completions through a rollout, which the assembly "
                                  "gives it; none is set")
            batch = self.rollout(raw)
            if self.replay is not None and not raw.greedy:
                self.replay.add(batch)
            return batch
        return super().batch_of(raw)

    @property
    def sequence_level(self) -> bool:
        return self.algorithm == "rloo"

    def num_targets(self, batch: RolloutBatch) -> int:
        if self.sequence_level:
            return batch.rows
        return aggregate_count(batch.completion_mask, self.aggregation)

    def __call__(self, model: nn.Module, batch: RolloutBatch) -> ObjectiveOutput:
        if self.algorithm == "ppo":
            return self._ppo(model, batch)
        logps = token_logps(logits_of(model(batch.input_ids)), batch.targets)  # (N, T), 0 off completions
        mask = batch.completion_mask
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        if self.sequence_level:
            losses = sequence_losses(logps.sum(-1), old.sum(-1), batch.advantages, self.clip_eps,
                                     self.clip_eps_high)
            loss, ratio, kl = losses.sum(), torch.exp(logps - old), None
            if batch.ref_logps is not None:
                kl = kl_estimate(logps.detach(), batch.ref_logps, "k1")
        else:
            out = policy_token_losses(logps, old, batch.advantages, clip_low=self.clip_eps,
                                      clip_high=self.clip_eps_high, ref_logps=batch.ref_logps, beta=self.beta,
                                      kl=self.kl)
            loss = aggregate(out.losses, mask, self.aggregation, self.norm_length)
            ratio, kl = out.ratio, out.kl
        return ObjectiveOutput(loss, *self._metrics(batch, mask, ratio, kl))

    def _ppo(self, model: nn.Module, batch: RolloutBatch) -> ObjectiveOutput:
        """PPO: the clipped policy loss on the batch's (whitened GAE) advantages plus vf_coef x the
        clipped value loss against its returns, per completion token; the KL is in the rewards."""
        logits, hidden = model(batch.input_ids, head=lambda h, w: (F.linear(h, w), h))
        logps = token_logps(logits, batch.targets)
        values = model.value(hidden).squeeze(-1).float()
        mask = batch.completion_mask
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        pg = policy_token_losses(logps, old, batch.advantages, clip_low=self.clip_eps,
                                 clip_high=self.clip_eps_high)
        old_values = batch.old_values if batch.old_values is not None else values.detach()
        vl = value_losses(values, old_values, batch.returns, self.cliprange_value)
        loss = aggregate(pg.losses + self.vf_coef * vl, mask, self.aggregation, self.norm_length)
        kl = None if batch.ref_logps is None else kl_estimate(logps.detach(), batch.ref_logps, "k1")
        metrics, counts = self._metrics(batch, mask, pg.ratio, kl)
        tokens = mask.sum().float()
        metrics["value_loss"], counts["value_loss"] = (vl.detach() * mask).sum(), tokens
        metrics["value"], counts["value"] = (values.detach() * mask).sum(), tokens
        metrics["returns"], counts["returns"] = (batch.returns * mask).sum(), tokens
        return ObjectiveOutput(loss, metrics, counts)

    def _metrics(self, batch: RolloutBatch, mask: torch.Tensor, ratio: torch.Tensor, kl: torch.Tensor | None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Sums with their counts: per completion (rewards, length) or per completion token."""
        n = torch.tensor(float(batch.rows), device=mask.device)
        tokens = mask.sum().float()
        metrics = {"reward": batch.rewards.float().sum(),
                   "completion_tokens": tokens,
                   "mixed_groups": _mixed(batch)}
        counts = {"reward": n, "completion_tokens": n,
                  "mixed_groups": torch.tensor(float(batch.rows // batch.group_size), device=mask.device)}
        for name, part in (batch.reward_parts or {}).items():
            metrics[f"reward_{name}"], counts[f"reward_{name}"] = part.float().sum(), n
        if kl is not None:
            metrics["kl"], counts["kl"] = (kl.detach() * mask).sum(), tokens
        hi = 1 + (self.clip_eps if self.clip_eps_high is None else self.clip_eps_high)
        clipped = ((ratio.detach() < 1 - self.clip_eps) | (ratio.detach() > hi)) & mask
        metrics["clip_fraction"], counts["clip_fraction"] = clipped.float().sum(), tokens
        if self.iterations > 1 and batch.iteration:  # which update of its sampled batch (1 .. iterations)
            metrics["iteration"], counts["iteration"] = n * batch.iteration, n
        return metrics, counts


def _plain_int(value, key: str) -> int:
    """A saved count, refused unless it is a Python int (not a bool, float or tensor)."""
    if type(value) is not int:
        raise ValueError(f"the rl replay state's {key} is {type(value).__name__}, expected an int")
    return value


def _mixed(batch: RolloutBatch) -> torch.Tensor:
    """Groups whose completions got different rewards: only they carry a learning signal (a group of
    equal rewards has zero advantages)."""
    grouped = batch.rewards.float().view(-1, batch.group_size)
    return (grouped.max(1).values > grouped.min(1).values).float().sum()


class ReplayBuffer:
    """The rollouts of the last freshly sampled step, trained `iterations` updates in all.

    Before each step the Trainer asks `take()`: while the kept batches have updates left it returns
    them (each marked with its update number) and the step trains on them again; otherwise it returns
    None, the step draws prompts from the loader as usual, and the rollouts the objective makes of
    them are collected (`add`) for the next steps. Each data-parallel rank keeps its own (the
    completions of its prompts). Stateful: a checkpoint between the updates holds the kept batches
    (host tensors and plain data) and the resumed run trains the same updates on them."""

    def __init__(self, iterations: int, rank: int = 0, world_size: int = 1) -> None:
        self.iterations, self.rank, self.world_size = iterations, rank, world_size
        self.batches: list[RolloutBatch] = []
        self.uses = 0  # updates the kept batches have fed, the one being taken included
        self._collecting = False  # only a step that `take` sent to the loader adds its rollouts

    def place(self, rank: int, world_size: int) -> None:
        """The data-parallel rank whose batches this keeps (a resume must find the same layout)."""
        self.rank, self.world_size = rank, world_size

    @property
    def pending(self) -> bool:
        return bool(self.batches) and self.uses < self.iterations

    def take(self) -> list[RolloutBatch] | None:
        """The coming step's batches when it trains on the kept ones again, else None (it samples)."""
        if self.pending:
            self.uses += 1
            self._collecting = False
            return [replace(b, iteration=self.uses) for b in self.batches]
        self.batches, self.uses, self._collecting = [], 1, True
        return None

    def add(self, batch: RolloutBatch) -> None:
        if self._collecting:
            self.batches.append(batch)

    def state_dict(self) -> dict:
        kept = self.batches if self.pending else []  # used up: the next step samples anew, whatever they hold
        return {"iterations": self.iterations, "uses": self.uses, "rank": self.rank,
                "world_size": self.world_size, "batches": [b.state() for b in kept]}

    def load_state_dict(self, sd: dict) -> None:
        uses, saved = _plain_int(sd["uses"], "uses"), sd["batches"]
        if uses < 0 or not isinstance(saved, list) or not all(isinstance(b, dict) for b in saved):
            raise ValueError("the rl replay state's uses is negative or its batches are not a list of saved "
                             "rollout batches")
        batches = [RolloutBatch.from_state(b) for b in saved]
        layout = (_plain_int(sd["rank"], "rank"), _plain_int(sd["world_size"], "world_size"))
        if batches and layout != (self.rank, self.world_size):
            raise ConfigError(
                f"the checkpoint holds rank {layout[0]} of {layout[1]}'s sampled batch with updates left "
                f"(rl.iterations, {uses} of {_plain_int(sd['iterations'], 'iterations')} done); this is rank "
                f"{self.rank} of {self.world_size} data-parallel ranks. Resume on the old layout, or from a "
                "checkpoint taken at a sampled batch's last update")
        self.batches, self.uses, self._collecting = batches, uses, False
