"""Knowledge-distillation losses between a student's and a teacher's next-token distributions, summed
over the target positions (the step divides by the target count, as for every objective).

All three are divergences computed exactly (the teacher's entropy included), on logits / temperature
in float32:

  forward_kl   KL(teacher || student): mode-covering, Hinton et al.'s soft-target loss.
  reverse_kl   KL(student || teacher): mode-seeking (MiniLLM).
  jsd          generalised Jensen-Shannon with interpolation `beta` (GKD, Agarwal et al. 2024, Eq. 1):
               M = beta * teacher + (1 - beta) * student,
               beta * KL(teacher || M) + (1 - beta) * KL(student || M);
               beta 0 is forward KL and beta 1 reverse KL, TRL's `generalized_jsd_loss` convention.

Each per-position value equals TRL's `GKDTrainer.generalized_jsd_loss` at the same beta and
temperature (tests/parity/test_kd_losses.py), and its gradient equals torchtune's ForwardKLLoss /
ReverseKLLoss (which drop the teacher-entropy constant of forward KL). The sum is multiplied by
temperature**2 (Hinton et al. 2015) so that the gradient's scale does not shrink as T grows and a
mix with the hard-label loss keeps its balance across temperatures.

`topk_forward_kl_sum` is the forward KL against a teacher known by its k most likely tokens and its
log-normaliser (a precomputed cache), with the other tokens merged into one outcome.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

KD_LOSSES = ("forward_kl", "reverse_kl", "jsd")


def _up(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16 / fp16 logits are upcast; float64 stays, for reference checks)."""
    return x if x.dtype == torch.float64 else x.float()


def kd_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    loss: str = "forward_kl",
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """Per-position divergence (...,) between the distributions of logits (..., V), float32."""
    s = F.log_softmax(_up(student_logits) / temperature, dim=-1)  # (..., V)
    t = F.log_softmax(_up(teacher_logits) / temperature, dim=-1)  # (..., V)
    if loss == "jsd" and beta in (0.0, 1.0):
        loss = "forward_kl" if beta == 0.0 else "reverse_kl"
    if loss == "forward_kl":
        return _kl(t, s)
    if loss == "reverse_kl":
        return _kl(s, t)
    if loss != "jsd":
        raise ValueError(f"unknown distillation loss {loss!r}; valid: {', '.join(KD_LOSSES)}")
    # log M = logsumexp(log(1 - beta) + s, log(beta) + t), elementwise over the vocabulary
    m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))  # (..., V)
    return beta * _kl(t, m) + (1 - beta) * _kl(s, m)


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim from log-probabilities; 0 * log 0 counts as 0."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)


def kd_loss_sum(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    loss: str = "forward_kl",
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """temperature**2 * the divergence summed over the positions where `mask` (B, T) is True."""
    div = kd_divergence(student_logits, teacher_logits, loss, temperature, beta)  # (B, T)
    return (temperature**2) * torch.where(mask, div, torch.zeros_like(div)).sum()


def topk_forward_kl_sum(
    student_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_lse: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """temperature**2 * sum over masked positions of the forward KL between the teacher and the student
    over k + 1 outcomes: the teacher's top-k tokens (teacher_ids, teacher_topk_logits: (B, T, k)) and
    "any other token". teacher_lse (B, T) is the teacher's logsumexp(logits / temperature) over the
    whole vocabulary, so the k probabilities and the rest's mass are the teacher's exact ones; the
    student's come from its whole-vocabulary softmax. This is the KL of the two distributions with
    the tail merged into one outcome: exact on the top-k, never above the full KL."""
    s = F.log_softmax(_up(student_logits) / temperature, dim=-1)  # (B, T, V)
    s_k = s.gather(-1, teacher_ids.long())  # (B, T, k)
    t_k = _up(teacher_topk_logits) / temperature - _up(teacher_lse)[..., None]  # (B, T, k) log-probs
    p_k = t_k.exp()
    rest_p = (1 - p_k.sum(-1)).clamp(min=0.0)  # (B, T)
    rest_q = (1 - s_k.exp().sum(-1)).clamp(min=1e-30)  # (B, T)
    div = (p_k * (t_k - s_k)).sum(-1)
    div = div + torch.where(rest_p > 0, rest_p * (rest_p.clamp(min=1e-30).log() - rest_q.log()), 0.0)
    return (temperature**2) * torch.where(mask, div, torch.zeros_like(div)).sum()
