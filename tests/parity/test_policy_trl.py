"""Policy-gradient losses against TRL's own code, fed the same per-token log-probs, advantages and
masks (float64, so the comparison at 1e-12 shows the formulas, not rounding; a float32 run checks 1e-6).

TRL computes the GRPO and RLOO losses inside GRPOTrainer._compute_loss / RLOOTrainer._compute_loss,
which read settings from the trainer, call the model and log through its accelerator: they are
called here unbound, on a stand-in holding exactly the attributes they read, whose
`_get_per_token_logps_and_entropies` returns the given per-token log-probs (a leaf, so the gradients
of both losses can be compared too). The sampling policy's and the reference model's log-probs differ
from the policy's, so the ratio straddles both clip bounds for positive and negative advantages.

Each aggregation mode equals a TRL loss_type (single process, one micro-batch):
  seq-mean-token-mean = grpo, token-mean = bnpo and dapo (num_items_in_batch = the mask's sum),
  seq-mean-token-sum-norm = dr_grpo (norm_length = max_completion_length), seq-mean-token-sum = luspo
  (at importance_sampling_level="token", where TRL's luspo is the clipped token loss summed per sequence).

TRL computes advantages inline in `_generate_and_score_completions`, which cannot be called alone:
`group_advantages` is compared with TRL's lines copied here (using TRL's own nanstd) and with small
examples worked by hand. (verl's compute_grpo_outcome_advantage / compute_rloo_outcome_advantage agree
too, with its epsilon 1e-6 passed as eps=, but verl cannot be imported without its heavy dependencies,
so it is not used here.)
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.rloo_trainer import RLOOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

from lmforge.engine.policy_loss import (  # noqa: E402
    aggregate,
    aggregate_count,
    group_advantages,
    kl_estimate,
    policy_token_losses,
    sequence_losses,
)

N, T = 8, 10  # completions, completion length (padded)
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-6, atol=1e-6)}
# our aggregation mode -> the TRL GRPO loss_type that equals it
TRL_LOSS_TYPE = {"seq-mean-token-mean": "grpo", "token-mean": "bnpo", "seq-mean-token-sum-norm": "dr_grpo",
                 "seq-mean-token-sum": "luspo"}


class _Accelerator:
    device = torch.device("cpu")
    num_processes = 1
    process_index = 0
    sync_gradients = True

    @staticmethod
    def gather(t):
        return t

    gather_for_metrics = gather

    @staticmethod
    def reduce(t, reduction="sum"):
        return t


def _trainer(logps: torch.Tensor, **settings) -> SimpleNamespace:
    """What TRL's GRPO / RLOO _compute_loss reads from `self`; the model call returns `logps` (N, T)
    with zero entropies."""
    entropies = torch.zeros_like(logps.detach())
    base = dict(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, entropies, None),
        model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False,
        _entropy_bonus_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", use_vllm=False, current_gradient_accumulation_steps=1,
        max_completion_length=T, beta=0.0, epsilon_low=0.2, epsilon_high=0.2,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    return SimpleNamespace(**{**base, **settings})


def _batch(dtype: torch.dtype, seed: int, n: int = N):
    """Per-token log-probs of the policy (a leaf), the sampling policy and the reference (n, T), a
    right-padded completion mask of random lengths 1..T (one row full), advantages (n,) of both signs.
    Padding positions hold arbitrary log-probs: only the mask may keep them out of the loss."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T) < lengths[:, None]).long()
    logps = -torch.rand(n, T, generator=g, dtype=torch.float64) * 3
    old = logps + (torch.rand(n, T, generator=g, dtype=torch.float64) - 0.5) * 1.4  # ratio in (0.5, 2)
    ref = logps + 0.5 * torch.randn(n, T, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[:2] = torch.tensor([0.7, -0.9], dtype=torch.float64)
    return logps.to(dtype).requires_grad_(), old.to(dtype), ref.to(dtype), mask, adv.to(dtype)


def _ids(mask: torch.Tensor) -> dict:
    """Token ids and masks TRL concatenates for its model call (which the stand-in ignores)."""
    n, t = mask.shape
    long = dict(dtype=torch.long)
    return dict(prompt_ids=torch.zeros(n, 3, **long), prompt_mask=torch.ones(n, 3, **long),
                completion_ids=torch.zeros(n, t, **long), completion_mask=mask)


def _grpo_inputs(mask, adv, old, ref):
    return dict(**_ids(mask), advantages=adv, old_per_token_logps=old, ref_per_token_logps=ref,
                num_items_in_batch=mask.sum().to(adv.dtype))


def _ours(logps, old, ref, mask, adv, mode, clip_low, clip_high, beta):
    out = policy_token_losses(logps, old, adv, clip_low=clip_low, clip_high=clip_high, ref_logps=ref,
                              beta=beta)
    return aggregate(out.losses, mask, mode, norm_length=T) / aggregate_count(mask, mode), out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("clip_high", [0.2, 0.28])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type,mode", [("grpo", "seq-mean-token-mean"), ("dapo", "token-mean"),
                                            ("bnpo", "token-mean"), ("dr_grpo", "seq-mean-token-sum-norm"),
                                            ("luspo", "seq-mean-token-sum")])
def test_policy_loss_and_gradient_equal_trl_grpo_trainer(loss_type, mode, beta, clip_high, dtype):
    logps, old, ref, mask, adv = _batch(dtype, seed=1)
    clip_low = 0.2
    trl_self = _trainer(logps, loss_type=loss_type, beta=beta, epsilon_low=clip_low, epsilon_high=clip_high)
    theirs = GRPOTrainer._compute_loss(trl_self, None, _grpo_inputs(mask, adv, old, ref))
    ours, out = _ours(logps, old, ref, mask, adv, mode, clip_low, clip_high, beta)
    torch.testing.assert_close(ours, theirs, **TOL[dtype])
    (grad_theirs,) = torch.autograd.grad(theirs, logps)
    (grad_ours,) = torch.autograd.grad(ours, logps)
    torch.testing.assert_close(grad_ours, grad_theirs, **TOL[dtype])
    assert (grad_ours[mask == 0] == 0).all()

    # the data exercise every branch of the clipped surrogate on completion tokens
    ratio, a, m = out.ratio.detach(), adv[:, None].expand(-1, T), mask.bool()
    low, high = ratio < 1 - clip_low, ratio > 1 + clip_high
    for region in (low & (a < 0), low & (a > 0), high & (a > 0), high & (a < 0), ~low & ~high):
        assert (region & m).any()
    # TRL's logged clip fractions (which it counts in float32: `.float()`) and KL are ours too
    metrics = trl_self._metrics["train"]
    masked_mean = lambda x: ((x.to(dtype) * mask).sum() / mask.sum()).item()  # noqa: E731
    assert metrics["clip_ratio/low_mean"][0] == pytest.approx(masked_mean(low & (a < 0)), rel=1e-6)
    assert metrics["clip_ratio/high_mean"][0] == pytest.approx(masked_mean(high & (a > 0)), rel=1e-6)
    if beta:
        assert metrics["kl"][0] == pytest.approx(masked_mean(out.kl.detach()), rel=1e-6)
    else:
        assert out.kl is None and "kl" not in metrics


def _trim(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A micro-batch padded only to its own longest completion."""
    return x[:, : int(mask.sum(1).max())]


@pytest.mark.parametrize("mode", list(TRL_LOSS_TYPE))
def test_micro_batches_summed_and_divided_by_the_step_count_equal_one_batch(mode):
    """The lmforge step sums `aggregate` over micro-batches and divides by the `aggregate_count` of
    all of them: that equals TRL's loss (and gradient) on the whole batch, whatever the split and
    each micro-batch's padded length."""
    logps, old, ref, mask, adv = _batch(torch.float64, seed=2)
    beta, clip_low, clip_high = 0.04, 0.2, 0.28
    trl_self = _trainer(logps, loss_type=TRL_LOSS_TYPE[mode], beta=beta, epsilon_low=clip_low,
                        epsilon_high=clip_high)
    theirs = GRPOTrainer._compute_loss(trl_self, None, _grpo_inputs(mask, adv, old, ref))
    one, _ = _ours(logps, old, ref, mask, adv, mode, clip_low, clip_high, beta)

    total, count = 0.0, 0
    for rows in (slice(0, 3), slice(3, N)):
        m = mask[rows]
        lp, o, r = (_trim(x[rows], m) for x in (logps, old, ref))
        out = policy_token_losses(lp, o, adv[rows], clip_low=clip_low, clip_high=clip_high, ref_logps=r,
                                  beta=beta)
        total = total + aggregate(out.losses, _trim(m, m), mode, norm_length=T)
        count += aggregate_count(_trim(m, m), mode)
    assert count == aggregate_count(mask, mode)
    split = total / count
    torch.testing.assert_close(split, one, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split, theirs, rtol=1e-12, atol=1e-12)
    (grad_split,) = torch.autograd.grad(split, logps)
    (grad_theirs,) = torch.autograd.grad(theirs, logps)
    torch.testing.assert_close(grad_split, grad_theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("clip_high", [0.2, 0.28])
def test_sequence_losses_equal_trl_rloo_trainer(clip_high, dtype):
    """RLOO's surrogate clips the ratio of whole sequences' summed log-probs; the loss is the mean."""
    logps, _, _, mask, adv = _batch(dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    seq = (logps * mask).sum(1)
    old_seq = seq.detach() + (torch.rand(N, generator=g, dtype=torch.float64).to(dtype) - 0.5) * 1.4
    clip_low = 0.2
    trl_self = _trainer(logps, epsilon_low=clip_low, epsilon_high=clip_high)
    inputs = dict(**_ids(mask), old_logps=old_seq, advantages=adv)
    theirs = RLOOTrainer._compute_loss(trl_self, None, inputs)
    losses = sequence_losses(seq, old_seq, adv, clip_low=clip_low, clip_high=clip_high)
    ours = losses.mean()
    torch.testing.assert_close(ours, theirs, **TOL[dtype])
    # as one "token" per sequence, seq-mean-token-sum gives the same mean
    ones = torch.ones(N, 1, dtype=torch.long)
    mode = "seq-mean-token-sum"
    via_aggregate = aggregate(losses[:, None], ones, mode) / aggregate_count(ones, mode)
    torch.testing.assert_close(via_aggregate, ours, **TOL[dtype])
    (grad_theirs,) = torch.autograd.grad(theirs, logps)
    (grad_ours,) = torch.autograd.grad(ours, logps)
    torch.testing.assert_close(grad_ours, grad_theirs, **TOL[dtype])

    ratio = torch.exp(seq - old_seq).detach()
    low, high = ratio < 1 - clip_low, ratio > 1 + clip_high
    assert (low & (adv < 0)).any() and (high & (adv > 0)).any() and (~low & ~high).any()
    metrics = trl_self._metrics["train"]
    assert metrics["clip_ratio/low_mean"][0] == pytest.approx((low & (adv < 0)).double().mean().item())
    assert metrics["clip_ratio/high_mean"][0] == pytest.approx((high & (adv > 0)).double().mean().item())


def _trl_grpo_advantages(rewards: torch.Tensor, group_size: int, scale: str) -> torch.Tensor:
    """GRPOTrainer._generate_and_score_completions (one reward function, no unscorable completion)."""
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, group_size), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(group_size, dim=0)
    if scale in ["group", "none"]:
        if group_size > 1:
            std_rewards = nanstd(rewards.view(-1, group_size), dim=1)
            std_rewards = std_rewards.repeat_interleave(group_size, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def _trl_rloo_advantages(rewards: torch.Tensor, group_size: int, normalize: bool) -> torch.Tensor:
    """RLOOTrainer._generate_and_score_completions (no KL in the reward, every completion scorable)."""
    grouped_rewards = rewards.view(-1, group_size)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    if group_size > 1:
        baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
        advantages = rewards - baselines.view(-1)
    else:
        advantages = torch.zeros_like(rewards)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def _rewards(group_size: int, groups: int = 6) -> torch.Tensor:
    """Float32 rewards: random groups, a 0/1 group, a group of equal rewards (std 0)."""
    g = torch.Generator().manual_seed(5 + group_size)
    r = torch.randn(groups * group_size, generator=g)
    if group_size > 1:
        r[:group_size] = (torch.arange(group_size) == 0).float()
        r[group_size: 2 * group_size] = 0.5
    return r


@pytest.mark.parametrize("group_size", [1, 2, 4, 7])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_advantages_equal_trl(scale, group_size):
    r = _rewards(group_size)
    ours = group_advantages(r, group_size, "grpo", scale)
    torch.testing.assert_close(ours, _trl_grpo_advantages(r, group_size, scale), rtol=1e-6, atol=1e-6)
    if group_size > 1:  # each group is centred
        torch.testing.assert_close(ours.view(-1, group_size).sum(1), torch.zeros(6), rtol=0, atol=1e-5)


@pytest.mark.parametrize("group_size", [1, 2, 4, 7])
@pytest.mark.parametrize("scale", ["batch", "none"])
def test_rloo_advantages_equal_trl(scale, group_size):
    r = _rewards(group_size)
    ours = group_advantages(r, group_size, "rloo", scale)
    expected = _trl_rloo_advantages(r, group_size, normalize=scale == "batch")
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)


def test_advantages_worked_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean 1/4, unbiased std sqrt((9/16 + 3/16) / 3) = 1/2; group 2: all equal -> 0
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(r, 4), centred / (0.5 + 1e-4))
    torch.testing.assert_close(group_advantages(r, 4, scale="none"), centred)
    torch.testing.assert_close(group_advantages(r, 4, eps=1e-6), centred / (0.5 + 1e-6))
    # batch std of the 8 rewards: mean 9/8, sum of squares 1/64 + 3 x 81/64 + 4 x 49/64 = 440/64
    batch_std = math.sqrt(440 / 64 / 7)
    torch.testing.assert_close(group_advantages(r, 4, scale="batch"), centred / (batch_std + 1e-4))
    # rloo: baseline of the 1 is 0, of each 0 is 1/3; equal rewards -> 0
    loo = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(r, 4, "rloo", "none"), loo)
    # rloo = grpo's centred reward x G / (G - 1)
    torch.testing.assert_close(group_advantages(r, 4, "rloo", "none"), centred * 4 / 3)
    # one completion per prompt: nothing to compare with
    assert torch.equal(group_advantages(r, 1), torch.zeros(8))
    assert torch.equal(group_advantages(r, 1, "rloo", "batch"), torch.zeros(8))
    # 0/1 (bool) rewards are taken as floats: group [1, 0] has mean 1/2 and unbiased std sqrt(1/2)
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0]) / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(group_advantages(r[:4].bool(), 2), expected)


def test_kl_estimators_follow_their_formulas_and_k3_is_unbiased_and_non_negative():
    g = torch.Generator().manual_seed(6)
    logp = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 4
    lr = logp - ref
    tol = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), lr, **tol)
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), lr.square() / 2, **tol)
    # TRL's form of k3: exp(ref - logp) - (ref - logp) - 1
    torch.testing.assert_close(kl_estimate(logp, ref), torch.exp(ref - logp) - (ref - logp) - 1, **tol)
    assert (kl_estimate(logp, ref) >= 0).all()
    assert torch.equal(kl_estimate(logp, logp), torch.zeros_like(logp))
    # over a whole categorical distribution p, E_p[k1] = E_p[k3] = KL(p || q) exactly
    p_logits, q_logits = torch.randn(2, 11, generator=g, dtype=torch.float64)
    lp, lq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum()
    for kind in ("k1", "k3"):
        torch.testing.assert_close((lp.exp() * kl_estimate(lp, lq, kind)).sum(), kl, **tol)
    with pytest.raises(ValueError, match="KL estimator"):
        kl_estimate(logp, ref, "k4")


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_on_policy_gradient_is_reinforce(beta):
    """At ratio 1 (old = logps.detach(), TRL's single-iteration shortcut) nothing is clipped and the
    token loss's gradient is -A per token; the k3 penalty at policy = reference adds none."""
    logps, _, _, mask, _ = _batch(torch.float64, seed=7)
    adv = torch.randn(N, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    out = policy_token_losses(logps, logps.detach(), adv, clip_high=0.28, ref_logps=logps.detach(), beta=beta)
    torch.testing.assert_close(out.ratio, torch.ones(N, T, dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(out.losses, -adv[:, None].expand(N, T), rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out.losses.sum(), logps)
    torch.testing.assert_close(grad, -adv[:, None].expand(N, T), rtol=1e-12, atol=1e-12)
    # per-token advantages (N, T) work the same way
    per_token = policy_token_losses(logps, logps.detach(), adv[:, None].expand(N, T)).losses
    (grad_t,) = torch.autograd.grad(per_token.sum(), logps)
    torch.testing.assert_close(grad_t, grad, rtol=0, atol=0)
    # TRL's grpo loss without old_per_token_logps uses the same shortcut
    inputs = _grpo_inputs(mask, adv, None, logps.detach())
    del inputs["old_per_token_logps"]
    theirs = GRPOTrainer._compute_loss(_trainer(logps, loss_type="grpo", beta=beta), None, inputs)
    ours = aggregate(out.losses, mask, "seq-mean-token-mean") / aggregate_count(mask, "seq-mean-token-mean")
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(theirs, -adv.mean(), rtol=1e-12, atol=1e-12)


def test_bad_arguments_are_refused():
    r = torch.zeros(6)
    with pytest.raises(ValueError, match="advantage estimator"):
        group_advantages(r, 3, "ppo")
    with pytest.raises(ValueError, match="reward scaling"):
        group_advantages(r, 3, scale="global")
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(r, 4)
    with pytest.raises(ValueError, match="rloo"):
        group_advantages(r, 3, "rloo", "group")
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="reference model"):
        policy_token_losses(x, x, torch.zeros(2), beta=0.1)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(x, m, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss aggregation"):
        aggregate(x, m, "sum")
    with pytest.raises(ValueError, match="loss aggregation"):
        aggregate_count(m, "sum")
