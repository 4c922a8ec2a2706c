"""Policy-gradient losses for RL on sampled completions: group-relative advantages (GRPO, RLOO), the
clipped surrogate with a KL penalty towards a reference model, and the ways per-token losses are
summed into one number.

Conventions and formulas are TRL's GRPOTrainer / RLOOTrainer, which tests/parity/test_policy_trl.py
compares against; the aggregation modes carry verl's names (its `agg_loss`), with the TRL loss_type
each one equals:

  token-mean               sum of token losses / completion tokens of the whole step   (TRL dapo, bnpo)
  seq-mean-token-mean      mean over sequences of each one's token mean                 (TRL grpo)
  seq-mean-token-sum       mean over sequences of each one's token sum                 (RLOO's sequence loss)
  seq-mean-token-sum-norm  token sum / (sequences x norm_length)                       (TRL dr_grpo, Dr. GRPO)

Every mode is a sum over the batch (`aggregate`) and a count (`aggregate_count`); the step divides
the sum by the count of the whole step (all micro-batches, all data-parallel ranks), so gradient
accumulation and data parallelism equal one big batch.

  advantage grpo   (r - mean of its group) / (std of its group + 1e-4)    (scale=group; batch: std of all;
                                                                            none: no division: Dr. GRPO)
  advantage rloo   r - mean of the other G - 1 rewards of its group        (scale=batch: then whitened)
  token loss       -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta KL,   rho = p / p_old
  KL (k3)          exp(ref - logp) - (ref - logp) - 1                     (Schulman's unbiased, >= 0)

PPO (RLHF as InstructGPT / TRL's former PPOTrainer / OpenRLHF / torchtune do it): per-token rewards
-beta (log p_old - log p_ref) with the sequence's score added at its last token (`token_rewards`),
GAE advantages and returns over the completion (`gae`), advantages whitened over the batch's
completion tokens (`masked_whiten`), and the clipped value loss (`value_losses`)

  delta_t = r_t + gamma V_t+1 - V_t,   A_t = sum_k (gamma lambda)^k delta_t+k,   R_t = A_t + V_t
  value   0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ESTIMATORS = ("grpo", "rloo")
SCALINGS = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")

__all__ = [
    "gae",
    "masked_whiten",
    "token_rewards",
    "value_losses",
    "AGGREGATIONS",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "SCALINGS",
    "TokenLosses",
    "aggregate",
    "aggregate_count",
    "group_advantages",
    "kl_estimate",
    "policy_token_losses",
    "sequence_losses",
]


def group_advantages(rewards: torch.Tensor, group_size: int, estimator: str = "grpo", scale: str = "group",
                     eps: float = 1e-4) -> torch.Tensor:
    """Advantages (N,) of rewards (N,) that come in consecutive groups of `group_size` completions of
    one prompt. grpo: minus the group mean, divided by the group's (unbiased) std + eps (scale=group),
    by the whole batch's (batch) or not at all (none). rloo: minus the leave-one-out mean of the
    group; scale=batch whitens the result over the batch (TRL's normalize_advantages)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r} is not one of {', '.join(ESTIMATORS)}")
    if scale not in SCALINGS:
        raise ValueError(f"reward scaling {scale!r} is not one of {', '.join(SCALINGS)}")
    n = rewards.numel()
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of {group_size}")
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    grouped = rewards.view(-1, group_size)
    if group_size == 1:  # nothing to compare with (greedy evaluation): no signal
        return torch.zeros_like(rewards)
    if estimator == "rloo":
        if scale == "group":
            raise ValueError("rloo advantages take scale=none or batch (the leave-one-out baseline already "
                             "centres each group)")
        baseline = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
        adv = (grouped - baseline).reshape(-1)
        if scale == "batch":
            adv = (adv - adv.mean()) / (adv.std() + eps) if n > 1 else torch.zeros_like(adv)
        return adv
    adv = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
    if scale == "group":
        std = grouped.std(1).repeat_interleave(group_size)
    elif scale == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        return adv
    return adv / (std + eps)


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs: k1 = log r,
    k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1 with log r = logp - ref (Schulman 2020)."""
    log_ratio = logps - ref_logps
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"KL estimator {kind!r} is not one of {', '.join(KL_ESTIMATORS)}")


class TokenLosses(NamedTuple):
    """losses (N, T): per completion token (mask them before summing); ratio (N, T): p / p_old;
    kl (N, T) or None: the KL estimate (with beta > 0)."""

    losses: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor | None


def policy_token_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    kl: str = "k3",
) -> TokenLosses:
    """The clipped surrogate per token (PPO's, as GRPO uses it): logps / old_logps / ref_logps (N, T)
    are the policy's, the sampling policy's and the reference model's log-probs of the sampled
    tokens; advantages (N,) one per sequence (or (N, T) per token). beta > 0 adds beta x KL."""
    clip_high = clip_low if clip_high is None else clip_high
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    losses = -torch.min(ratio * adv, clipped * adv)
    kl_t = None
    if beta:
        if ref_logps is None:
            raise ValueError("a KL penalty (beta > 0) needs the reference model's log-probs")
        kl_t = kl_estimate(logps, ref_logps, kl)
        losses = losses + beta * kl_t
    return TokenLosses(losses, ratio, kl_t)


def sequence_losses(seq_logps: torch.Tensor, old_seq_logps: torch.Tensor, advantages: torch.Tensor,
                    clip_low: float = 0.2, clip_high: float | None = None) -> torch.Tensor:
    """RLOO's clipped surrogate on whole sequences (N,): the ratio of the summed completion log-probs
    (TRL's RLOOTrainer; its KL penalty is in the reward, not here)."""
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(seq_logps - old_seq_logps)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return -torch.min(ratio * advantages, clipped * advantages)


def aggregate(token_losses: torch.Tensor, mask: torch.Tensor, mode: str,
              norm_length: int | None = None) -> torch.Tensor:
    """The batch's share of `mode`'s loss as a sum: divided by `aggregate_count` (summed over the
    whole step) it is the mode's mean (see the module docstring). mask (N, T): the completion tokens."""
    m = mask.to(token_losses.dtype)
    per_token = token_losses * m
    if mode == "token-mean" or mode == "seq-mean-token-sum":
        return per_token.sum()
    if mode == "seq-mean-token-mean":
        return (per_token.sum(-1) / m.sum(-1).clamp(min=1.0)).sum()
    if mode == "seq-mean-token-sum-norm":
        if not norm_length:
            raise ValueError("seq-mean-token-sum-norm divides by a fixed length: give norm_length")
        return per_token.sum() / norm_length
    raise ValueError(f"loss aggregation {mode!r} is not one of {', '.join(AGGREGATIONS)}")


def aggregate_count(mask: torch.Tensor, mode: str) -> int:
    """What `mode` averages over in this batch: completion tokens (token-mean) or sequences."""
    if mode == "token-mean":
        return int(mask.sum())
    if mode not in AGGREGATIONS:
        raise ValueError(f"loss aggregation {mode!r} is not one of {', '.join(AGGREGATIONS)}")
    return int(mask.shape[0])


def token_rewards(scores: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor | None,
                  mask: torch.Tensor, beta: float) -> torch.Tensor:
    """PPO's per-token rewards (N, T): -beta (log p_old - log p_ref) on every completion token (k1, the
    KL penalty as a reward) and each sequence's score (N,) added at its last completion token."""
    m = mask.to(old_logps.dtype)
    rewards = torch.zeros_like(old_logps)
    if beta and ref_logps is not None:
        rewards = -beta * (old_logps - ref_logps) * m
    pos = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    last = torch.where(mask, pos, -1).amax(-1)  # (N,): -1 for a row without completion tokens
    has = last >= 0
    rows = torch.arange(mask.size(0), device=mask.device)[has]
    return rewards.index_put((rows, last[has]), scores[has].to(rewards.dtype), accumulate=True)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's completion tokens: (advantages, returns), both
    (N, T) and 0 off the mask. The value after a completion's last token is 0 (the episode ends)."""
    m = mask.to(values.dtype)
    v = values * m
    r = rewards * m
    adv = torch.zeros_like(v)
    last = torch.zeros_like(v[:, 0])
    for t in range(v.size(1) - 1, -1, -1):
        next_v = v[:, t + 1] if t + 1 < v.size(1) else torch.zeros_like(last)
        delta = r[:, t] + gamma * next_v - v[:, t]
        last = (delta + gamma * lam * last) * m[:, t]
        adv[:, t] = last
    return adv, (adv + v) * m


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
                  ) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (unbiased variance, as TRL's whiten), 0 off
    the mask; shift_mean=False adds the mean back."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = ((x - mean).square() * m).sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def value_losses(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
                 ) -> torch.Tensor:
    """PPO's clipped value loss per token: 0.5 max((V - R)^2, (V_old + clip(V - V_old) - R)^2); without
    `clip`, 0.5 (V - R)^2."""
    loss = (values - returns).square()
    if clip is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.max(loss, (clipped - returns).square())
    return 0.5 * loss
