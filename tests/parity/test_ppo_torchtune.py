"""PPO against torchtune's own code: `torchtune.rlhf.estimate_advantages` (GAE, then whitening over the
response mask; torchtune adds the mean back after whitening, TRL and lmforge do not, which the test
accounts for) and `torchtune.rlhf.loss.PPOLoss` (clipped policy loss + value_coeff x the clipped value
loss, masked means) on the same log-probs, values, rewards and masks, at 1e-12 in float64 (the
whitening at 1e-7: see the test).

TRL 1.16 no longer ships a PPO trainer and verl's functions need its whole dependency tree, so
torchtune is the reference. Its package imports torchao and its datasets stack on `import torchtune`;
the two files compared here need only torch, so they are loaded from the installed package directly.
Without torchtune installed (it is not a test dependency: `pip install torchtune --no-deps` is enough)
the test is skipped."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from lmforge.engine.policy_loss import (
    aggregate,
    aggregate_count,
    gae,
    masked_whiten,
    policy_token_losses,
    value_losses,
)


def _torchtune():
    spec = importlib.util.find_spec("torchtune")  # finds the package without importing it
    if spec is None or spec.origin is None:
        pytest.skip("torchtune is not installed (pip install torchtune --no-deps runs this cross-check)")
    root = Path(spec.origin).parent / "rlhf"

    def load(name: str, path: Path):
        s = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(s)
        s.loader.exec_module(module)
        return module

    rewards = load("_tt_rewards", root / "rewards.py")
    fake = types.ModuleType("torchtune")
    fake.rlhf = types.SimpleNamespace(masked_mean=rewards.masked_mean)
    saved = sys.modules.get("torchtune")
    sys.modules["torchtune"] = fake
    try:
        ppo = load("_tt_ppo", root / "loss" / "ppo.py")
    finally:
        if saved is None:
            sys.modules.pop("torchtune", None)
        else:
            sys.modules["torchtune"] = saved
    return rewards, ppo


def _batch(seed: int, prompt: int = 3, response: int = 7):
    """Rows of prompt + response positions (lmforge's layout) and the response-only views (torchtune's):
    response lengths differ, values and rewards past a response's end are 0 as torchtune's recipe
    leaves them."""
    g = torch.Generator().manual_seed(seed)
    n = 5
    lengths = torch.tensor([7, 3, 5, 1, 6])
    resp_mask = torch.arange(response)[None] < lengths[:, None]
    values = torch.randn(n, response, generator=g, dtype=torch.float64) * resp_mask
    rewards = torch.randn(n, response, generator=g, dtype=torch.float64) * 0.1 * resp_mask
    full = lambda x: torch.cat([torch.zeros(n, prompt, dtype=x.dtype), x], 1)  # noqa: E731
    return resp_mask, values, rewards, full


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0)])
def test_gae_and_whitening_equal_torchtune(gamma, lam):
    tt_rewards, _ = _torchtune()
    mask, values, rewards, full = _batch(0)
    theirs_adv, theirs_ret = tt_rewards.estimate_advantages(values, rewards, gamma, lam, masks=mask)
    adv, ret = gae(full(rewards), full(values), full(mask), gamma, lam)
    # GAE: torchtune whitens inside estimate_advantages; its own whiten of our GAE gives its result exactly
    torch.testing.assert_close(tt_rewards.whiten(adv[:, 3:], mask=mask)[mask], theirs_adv[mask], rtol=0,
                               atol=1e-12)
    # whitening: torchtune's whiten(shift_mean=True) adds the mean back (TRL's, whose convention lmforge
    # follows, leaves it out: zero-mean advantages), and its masked mean and Bessel factor add 1e-8 to the
    # token count (TRL's core.py formulas), which moves the result by ~1e-8 of its scale
    ours = masked_whiten(adv, full(mask))[:, 3:]
    mean = adv[:, 3:][mask].mean()
    torch.testing.assert_close(ours[mask] + mean, theirs_adv[mask], rtol=0, atol=1e-7)
    torch.testing.assert_close(ret[:, 3:][mask], theirs_ret[mask], rtol=0, atol=1e-12)


@pytest.mark.parametrize("clip,value_clip,coeff", [(0.2, 0.2, 0.1), (0.1, 0.5, 1.0)])
def test_ppo_loss_equals_torchtune(clip, value_clip, coeff):
    _, tt_ppo = _torchtune()
    mask, old_values, _, _ = _batch(1)
    g = torch.Generator().manual_seed(2)
    n, t = mask.shape
    old = torch.randn(n, t, generator=g, dtype=torch.float64) - 2
    logps = (old + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    values = (old_values + 0.5 * torch.randn(n, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(n, t, generator=g, dtype=torch.float64)
    returns = old_values + torch.randn(n, t, generator=g, dtype=torch.float64)
    theirs = tt_ppo.PPOLoss(epsilon=clip, value_clip_range=value_clip, value_coeff=coeff)(
        old, logps, adv, old_values, values, returns, padding_masks=mask, value_padding_masks=mask)[0]
    g_theirs = torch.autograd.grad(theirs, [logps, values])
    pg = policy_token_losses(logps, old, adv, clip_low=clip)
    per_token = pg.losses + coeff * value_losses(values, old_values, returns, value_clip)
    ours = aggregate(per_token, mask, "token-mean") / aggregate_count(mask, "token-mean")
    g_ours = torch.autograd.grad(ours, [logps, values])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
