"""Preference-optimisation losses over sequence log-probabilities: the DPO family (DPO, conservative
DPO, IPO, hinge, robust DPO), the reference-free SimPO and ORPO, and KTO over unpaired examples.

Every function takes per-sequence sums of completion-token log-probabilities (and token counts where
the loss averages per token), returns per-example losses (a sum over them is what an objective hands
the step, which divides by the number of pairs of the whole step) and the implicit rewards logged as
rewards/chosen, rewards/rejected, margins and preference accuracy. Conventions, formulas and defaults
are those of TRL's DPOTrainer, CPOTrainer (SimPO), ORPOTrainer and KTOTrainer, which the parity tests
compare against at 1e-6 (tests/parity/test_preference_trl.py):

  sigmoid   -(1-e) log s(b D) - e log s(-b D),   D = (pc - rc) - (pr - rr)   (e > 0: conservative DPO)
  ipo       (Dc / nc - Dr / nr - 1 / (2 b))^2     per-token log-ratios, as TRL (confirmed by IPO's authors)
  hinge     relu(1 - b D)                          (SLiC)
  robust    ((1-e)(-log s(b D)) - e(-log s(-b D))) / (1 - 2e)   (rDPO: unbiased under label noise e)
  simpo     -(1-e) log s(b (pc/nc - pr/nr) - g) - e log s(-(...)),   no reference model
  orpo      nll(chosen, token mean) - b log s(log odds(pc/nc) - log odds(pr/nr)),   no reference model
  kto       w+ (1 - s(b (pc - rc - z))) for desirable, w- (1 - s(b (z - (pr - rr)))) for undesirable,
            z = max(0, mean over the batch of KL samples (p - r)), detached

s is the logistic sigmoid, b = beta, e = label_smoothing, g = simpo_gamma; p/r are policy/reference
summed log-probs, n the completion token counts.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lmforge.config.methods import REFERENCE_FREE  # the config's facts say which losses need no reference
from lmforge.data.batch import IGNORE_INDEX

PAIR_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")

__all__ = [
    "PAIR_LOSSES",
    "REFERENCE_FREE",
    "PairLosses",
    "kto_losses",
    "kto_reference_point",
    "log1mexp",
    "pair_losses",
    "sequence_logps",
    "token_logps",
]


class PairLosses(NamedTuple):
    """losses (P,): per pair; chosen/rejected rewards (P,), detached: the implicit rewards TRL logs."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position in fp32, 0 where the target is IGNORE_INDEX.

    logits (..., V) predict targets (...) (already shifted: position i's logits predict targets[i])."""
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, logp, 0.0)


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log p over each row's targets, number of targets per row), fp32 and int64, shape (B,)."""
    return token_logps(logits, targets).sum(-1), (targets != IGNORE_INDEX).sum(-1)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012: log(-expm1(x)) above -ln 2,
    log1p(-exp(x)) below)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _smoothed_logistic(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    loss = -F.logsigmoid(z)
    return loss if label_smoothing == 0 else (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-z)


def pair_losses(
    kind: str,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
    *,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    chosen_nll: torch.Tensor | None = None,
) -> PairLosses:
    """Per-pair losses of `kind` (one of PAIR_LOSSES; see the module docstring for each formula).

    chosen/rejected_logps (P,): the policy's summed completion log-probs. ref_*: the reference model's,
    needed unless kind is reference-free. *_tokens (P,): completion token counts, needed by ipo, simpo
    and orpo. chosen_nll (P,): the chosen completion's token-mean negative log-likelihood, for orpo
    (the policy's own, with gradient: ORPO is SFT plus an odds-ratio term)."""
    if kind not in PAIR_LOSSES:
        raise ValueError(f"unknown preference loss {kind!r}; expected one of {', '.join(PAIR_LOSSES)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if kind in ("ipo", "simpo", "orpo") and (chosen_tokens is None or rejected_tokens is None):
        raise ValueError(f"the {kind} loss averages per token: give chosen_tokens and rejected_tokens")

    def per_token(logps: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return logps / n.to(logps.dtype).clamp(min=1.0)

    if kind in REFERENCE_FREE:
        avg_c, avg_r = per_token(chosen_logps, chosen_tokens), per_token(rejected_logps, rejected_tokens)
        rewards = (beta * avg_c.detach(), beta * avg_r.detach())
        if kind == "simpo":
            margin = beta * (avg_c - avg_r) - simpo_gamma
            return PairLosses(_smoothed_logistic(margin, label_smoothing), *rewards)
        if chosen_nll is None:
            raise ValueError("the orpo loss adds the chosen completion's NLL: give chosen_nll")
        log_odds = (avg_c - avg_r) - (log1mexp(avg_c) - log1mexp(avg_r))
        return PairLosses(chosen_nll - beta * F.logsigmoid(log_odds), *rewards)

    if ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError(f"the {kind} loss needs the reference model's log-probs (ref_chosen/rejected_logps)")
    ratio_c, ratio_r = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    rewards = (beta * ratio_c.detach(), beta * ratio_r.detach())
    delta = ratio_c - ratio_r
    if kind == "sigmoid":
        losses = _smoothed_logistic(beta * delta, label_smoothing)
    elif kind == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif kind == "robust":
        e = label_smoothing
        losses = ((1 - e) * -F.logsigmoid(beta * delta) + e * F.logsigmoid(-beta * delta)) / (1 - 2 * e)
    else:  # ipo
        ipo_delta = per_token(ratio_c, chosen_tokens) - per_token(ratio_r, rejected_tokens)
        losses = (ipo_delta - 1 / (2 * beta)) ** 2
    return PairLosses(losses, *rewards)


def kto_losses(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO's per-example losses (N,) and rewards b (p - r) (N,, detached) for unpaired completions.

    logps/ref_logps (N,): summed completion log-probs; desirable (N,) bool; kl: the reference point z,
    a scalar the caller estimates from mismatched (prompt, completion) pairs of the batch as
    `kto_reference_point` does. Losses keep the batch order (TRL concatenates desirable then
    undesirable ones; a mean is the same either way)."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    ratio = logps - ref_logps
    z = kl.detach()
    good = desirable_weight * (1 - torch.sigmoid(beta * (ratio - z)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z - ratio)))
    return torch.where(desirable, good, bad), beta * ratio.detach()


def kto_reference_point(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """z = max(0, mean(policy - reference log-probs of mismatched pairs)), detached (KTO eq. 7)."""
    return (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
