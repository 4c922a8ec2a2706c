"""Preference losses against TRL's own code, fed the same per-token log-probs and masks (float64, so
the comparison at 1e-12 shows the formulas, not rounding; a float32 run checks 1e-6).

TRL computes each loss inside its trainers' loss methods, which read settings from the trainer and
log through its accelerator: those methods are called here unbound, on a stand-in holding exactly
the attributes they read (beta, loss type, label smoothing, ...), with a model stand-in returning the
given per-token log-probs. Compared: DPOTrainer._compute_loss (sigmoid, ipo, hinge, robust),
CPOTrainer.cpo_loss (sigmoid with label smoothing = conservative DPO's form; SimPO), ORPOTrainer's
odds_ratio_loss and KTOTrainer._compute_loss; the rewards TRL logs too.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

from trl.experimental.cpo.cpo_trainer import CPOTrainer  # noqa: E402
from trl.experimental.orpo.orpo_trainer import ORPOTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402

from lmforge.data.batch import IGNORE_INDEX  # noqa: E402
from lmforge.engine.preference_loss import (  # noqa: E402
    kto_losses,
    kto_reference_point,
    pair_losses,
    sequence_logps,
    token_logps,
)

P, L = 5, 12  # pairs, sequence length


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(t):
        return t

    gather_for_metrics = gather


def _trainer(**settings) -> SimpleNamespace:
    """What TRL's loss methods read from `self`."""
    base = dict(
        model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False,
        ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl", use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
        label_smoothing=0.0, alpha=0.0,
    )
    return SimpleNamespace(**{**base, **settings})


def _model(per_token: torch.Tensor):
    """A stand-in for TRL's fused-head model call: the per-token log-probs it would return."""

    def call(**kwargs):
        n = per_token.shape
        return SimpleNamespace(log_probs=per_token, entropy=torch.zeros(n, dtype=per_token.dtype),
                               mean_logits=torch.zeros(n, dtype=per_token.dtype),
                               is_top1=torch.zeros(n, dtype=torch.bool))

    return call


def _sequences(n: int, dtype: torch.dtype, seed: int):
    """Token log-probs (n, L-1) for shifted targets and completion masks (n, L) of random lengths:
    a prompt of 2-5 tokens, then a completion of 1 to the rest (right padding after it)."""
    g = torch.Generator().manual_seed(seed)
    completion = torch.zeros(n, L, dtype=torch.long)
    for i in range(n):
        start = int(torch.randint(2, 6, (1,), generator=g))
        end = int(torch.randint(start + 1, L + 1, (1,), generator=g))
        completion[i, start:end] = 1
    logp = -torch.rand(n, L - 1, generator=g, dtype=torch.float64) * 3  # log-probs in (-3, 0]
    logp = (logp * completion[:, 1:]).to(dtype)  # 0 where the target is not a completion token
    return logp, completion


def _ours_sums(logp: torch.Tensor, completion: torch.Tensor):
    return logp.sum(1), completion[:, 1:].sum(1)


TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-6, atol=1e-6)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind,smoothing", [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.1)])
def test_dpo_family_equals_trl_dpo_trainer(kind, smoothing, dtype):
    logp, completion = _sequences(2 * P, dtype, seed=1)
    ref = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    ref = ref * completion[:, 1:]
    ref_sums = ref.sum(1)
    beta = 0.2
    trl_self = _trainer(beta=beta, loss_types=[kind], loss_weights=[1.0], label_smoothing=smoothing)
    inputs = dict(input_ids=torch.zeros(2 * P, L, dtype=torch.long), attention_mask=torch.ones(2 * P, L),
                  completion_mask=completion, ref_chosen_logps=ref_sums[:P], ref_rejected_logps=ref_sums[P:])
    theirs = DPOTrainer._compute_loss(trl_self, _model(logp), inputs, return_outputs=False)

    sums, n = _ours_sums(logp, completion)
    # TRL counts IPO's tokens on the unshifted completion mask: the same count (position 0 is prompt)
    assert torch.equal(n, completion.sum(1))
    ours = pair_losses(kind, sums[:P], sums[P:], ref_sums[:P], ref_sums[P:], chosen_tokens=n[:P],
                       rejected_tokens=n[P:], beta=beta, label_smoothing=smoothing)
    torch.testing.assert_close(ours.losses.mean(), theirs, **TOL[dtype])
    metrics = trl_self._metrics["train"]
    assert ours.chosen_rewards.mean().item() == pytest.approx(metrics["rewards/chosen"][0], rel=1e-6)
    assert ours.rejected_rewards.mean().item() == pytest.approx(metrics["rewards/rejected"][0], rel=1e-6)
    accuracy = (ours.chosen_rewards > ours.rejected_rewards).double().mean().item()
    assert accuracy == pytest.approx(metrics["rewards/accuracies"][0], rel=1e-7)  # TRL's mean is fp32


@pytest.mark.parametrize("kind,smoothing", [("sigmoid", 0.15), ("simpo", 0.0), ("simpo", 0.1)])
def test_conservative_dpo_and_simpo_equal_trl_cpo_loss(kind, smoothing):
    """CPO's sigmoid loss is conservative DPO's formula over log-prob differences without a
    reference: ours with reference log-probs of 0 must equal it. SimPO: CPO with loss_type simpo over
    per-token average log-probs (TRL averages for simpo), with its gamma."""
    logp, completion = _sequences(2 * P, torch.float64, seed=3)
    sums, n = _ours_sums(logp, completion)
    beta, gamma = 2.0, 0.7
    trl_self = _trainer(beta=beta, loss_type=kind, label_smoothing=smoothing, simpo_gamma=gamma)
    trl_in = sums if kind == "sigmoid" else sums / n
    theirs, chosen_r, rejected_r = CPOTrainer.cpo_loss(trl_self, trl_in[:P], trl_in[P:])
    zero = torch.zeros(P, dtype=torch.float64)
    ours = pair_losses(kind, sums[:P], sums[P:], zero, zero, chosen_tokens=n[:P], rejected_tokens=n[P:],
                       beta=beta, label_smoothing=smoothing, simpo_gamma=gamma)
    torch.testing.assert_close(ours.losses, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.chosen_rewards, chosen_r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.rejected_rewards, rejected_r, rtol=1e-12, atol=1e-12)


def test_orpo_odds_ratio_equals_trl():
    """ORPO = NLL of the chosen completion minus beta x TRL's odds-ratio term (ORPOTrainer:
    `loss = policy_nll_loss - losses.mean()`, `losses = beta * logsigmoid(log_odds)`), including
    average log-probs near 0 where log(1 - p) needs log1mexp."""
    logp, completion = _sequences(2 * P, torch.float64, seed=4)
    logp = logp * 1e-3  # probabilities close to 1: 1 - p cancels without a careful log1mexp
    sums, n = _ours_sums(logp, completion)
    beta = 0.25
    trl_self = _trainer(beta=beta)
    avg = sums / n
    trl_losses, chosen_r, rejected_r, _, _ = ORPOTrainer.odds_ratio_loss(trl_self, avg[:P], avg[P:])
    nll = -(sums[:P] / n[:P])
    ours = pair_losses("orpo", sums[:P], sums[P:], chosen_tokens=n[:P], rejected_tokens=n[P:], beta=beta,
                       chosen_nll=nll)
    # TRL casts the log-probs to float32 first: agreement to float32's precision
    torch.testing.assert_close(ours.losses, nll - trl_losses.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.chosen_rewards, chosen_r.double(), rtol=1e-6, atol=1e-9)
    assert torch.isfinite(ours.losses).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kto_equals_trl_kto_trainer(dtype):
    n_ex = 7
    logp, completion = _sequences(n_ex, dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    ref = (logp + 0.4 * torch.randn(logp.shape, generator=g, dtype=dtype)) * completion[:, 1:]
    label = torch.tensor([True, False, True, True, False, False, True])
    kl_logps = -torch.rand(n_ex, generator=g, dtype=dtype) * 20
    ref_kl_logps = kl_logps - 0.5 * torch.rand(n_ex, generator=g, dtype=dtype)  # mean KL > 0
    beta, w_good, w_bad = 0.3, 1.0, 1.33
    trl_self = _trainer(beta=beta, loss_type="kto", calculate_KL=True, desirable_weight=w_good,
                        undesirable_weight=w_bad)
    trl_self._compute_kl_logps = lambda model, batch: kl_logps
    inputs = dict(input_ids=torch.zeros(n_ex, L, dtype=torch.long), attention_mask=torch.ones(n_ex, L),
                  completion_mask=completion, label=label, ref_logps=ref.sum(1), ref_KL_logps=ref_kl_logps)
    theirs = KTOTrainer._compute_loss(trl_self, _model(logp), inputs, return_outputs=False)

    z = kto_reference_point(kl_logps, ref_kl_logps)
    assert z > 0
    losses, rewards = kto_losses(logp.sum(1), ref.sum(1), label, z, beta=beta, desirable_weight=w_good,
                                 undesirable_weight=w_bad)
    torch.testing.assert_close(losses.mean(), theirs, **TOL[dtype])
    metrics = trl_self._metrics["train"]
    assert metrics["kl"][0] == pytest.approx(z.item(), rel=1e-6)
    assert rewards[label].mean().item() == pytest.approx(metrics["rewards/chosen"][0], rel=1e-6)
    # a negative batch KL estimate is clamped to 0
    assert kto_reference_point(ref_kl_logps, kl_logps).item() == 0.0


def test_dpo_at_policy_equal_reference_is_ln2_and_its_gradient_is_minus_beta_over_2():
    logp, completion = _sequences(2 * P, torch.float64, seed=7)
    sums = logp.sum(1).requires_grad_()
    ref = sums.detach().clone()
    out = pair_losses("sigmoid", sums[:P], sums[P:], ref[:P], ref[P:], beta=0.1)
    torch.testing.assert_close(out.losses, torch.full((P,), math.log(2.0), dtype=torch.float64))
    out.losses.sum().backward()
    # d/dpc -log s(b (pc - pr)) = -b s(-b D) = -b / 2 at D = 0; +b / 2 for the rejected
    torch.testing.assert_close(sums.grad, torch.tensor([-0.05] * P + [0.05] * P, dtype=torch.float64))


def test_sequence_logps_equal_trl_selective_log_softmax():
    from trl.trainer.utils import selective_log_softmax

    g = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 9, 17, generator=g)
    targets = torch.randint(0, 17, (3, 9), generator=g)
    targets[0, :4] = IGNORE_INDEX
    targets[2, 7:] = IGNORE_INDEX
    theirs = selective_log_softmax(logits, torch.where(targets == IGNORE_INDEX, 0, targets))
    theirs = theirs * (targets != IGNORE_INDEX)
    torch.testing.assert_close(token_logps(logits, targets), theirs, rtol=1e-6, atol=1e-6)
    sums, counts = sequence_logps(logits, targets)
    torch.testing.assert_close(sums, theirs.sum(1), rtol=1e-6, atol=1e-6)
    assert counts.tolist() == [5, 9, 7]


def test_bad_arguments_are_refused():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="unknown preference loss"):
        pair_losses("dpo", x, x, x, x)
    with pytest.raises(ValueError, match="reference model"):
        pair_losses("sigmoid", x, x)
    with pytest.raises(ValueError, match="chosen_tokens"):
        pair_losses("ipo", x, x, x, x)
    with pytest.raises(ValueError, match="chosen_nll"):
        pair_losses("orpo", x, x, chosen_tokens=x + 1, rejected_tokens=x + 1)
    with pytest.raises(ValueError, match="label_smoothing"):
        pair_losses("robust", x, x, x, x, label_smoothing=0.5)
    with pytest.raises(ValueError, match="beta"):
        pair_losses("sigmoid", x, x, x, x, beta=0.0)
