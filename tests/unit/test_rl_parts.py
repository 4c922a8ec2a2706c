"""RL pieces: prompt records, the prompt loader (seeded, resumable), batched sampling, rewards, the
rollout (rows, targets, group advantages, reference log-probs) and the rl objective inside the step
(accumulation equals one big batch; reward metrics are means per completion whatever the loss counts).
The loss formulas themselves are checked against TRL in tests/parity/test_policy_trl.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmforge.config.schema import ModelConfig, RLConfig
from lmforge.data.batch import IGNORE_INDEX, PromptBatch, RolloutBatch
from lmforge.data.chat import BadRecord
from lmforge.data.chat_loader import PromptLoader
from lmforge.data.prompts import to_prompt
from lmforge.data.sft import Example, SFTSplit
from lmforge.engine.objectives import PolicyGradient
from lmforge.engine.objectives.base import ObjectiveOutput
from lmforge.engine.precision import Precision
from lmforge.engine.preference_loss import token_logps
from lmforge.engine.step import MetricSums, train_step
from lmforge.finetune.rewards import exact_match, format_reward, score_replies
from lmforge.finetune.rollout import Rollout
from lmforge.models import build_model
from lmforge.models.generation import sample_replies

V = 40
STOP = 1


class CharTokenizer:
    """Token t decodes to chr(ord('0') + t % 10), the stop token to nothing."""

    def decode(self, ids):
        return "".join("" if t == STOP else chr(ord("0") + t % 10) for t in ids)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, vocab_size=V)
    return build_model(cfg)


def test_prompt_records_in_trl_and_chat_shapes():
    record = {"prompt": "What is 2 + 2?", "answer": "4", "task": "add", "difficulty": 1, "x": [1]}
    r = to_prompt(record, "f:1")
    assert r.messages == ({"role": "user", "content": "What is 2 + 2?"},)
    assert r.info == {"answer": "4", "task": "add", "difficulty": 1}  # non-scalar fields are dropped
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                         {"role": "assistant", "content": "a"}], "answer": "a"}
    assert [m["role"] for m in to_prompt(chat, "f:2").messages] == ["system", "user"]
    for bad, why in [({"prompt": "q"}, "'answer'"), ({"answer": "a"}, "needs 'prompt'"),
                     ({"prompt": "q", "answer": "a", "task": "nope"}, "not a shipped task"),
                     ({"messages": [{"role": "assistant", "content": "a"}], "answer": "a"},
                      "only an assistant"),
                     ([1, 2], "JSON object")]:
        with pytest.raises(BadRecord, match=why):
            to_prompt(bad, "f:3")


def _split(n: int) -> tuple[SFTSplit, list[dict]]:
    examples = [Example(np.arange(2 + i % 3, dtype=np.int32) + i, np.zeros(2 + i % 3, bool))
                for i in range(n)]
    return SFTSplit.of(examples), [{"answer": str(i)} for i in range(n)]


def test_prompt_loader_seeds_batches_by_position_and_resumes_exactly():
    split, info = _split(10)
    a = PromptLoader(split, info, 16, 3, seed=5)
    first = [a.next_batch() for _ in range(4)]
    assert all(b.rows == 3 and not b.greedy for b in first)
    assert len({b.seed for b in first}) == 4  # every position samples differently
    assert first[0].info[0]["answer"] == str(first[0].prompts[0][0])  # info follows its prompt
    b = PromptLoader(split, info, 16, 3, seed=5)
    b.load_state_dict(PromptLoader(split, info, 16, 3, seed=5).state_dict())
    b.load_state_dict({**a.state_dict(), "epoch": 0, "cursor": 2})
    assert b.next_batch() == first[2]  # same prompts, same seed
    evals = list(a.iter_eval_batches())
    assert all(e.greedy for e in evals) and sum(e.rows for e in evals) == 9
    assert PromptLoader(split, info, 16, 3, seed=6).next_batch().seed != first[0].seed
    with pytest.raises(Exception, match="answers"):
        PromptLoader(split, info[:-1], 16, 3)


def test_sampling_is_seeded_and_greedy_batches_equal_each_prompt_alone(model):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    a = sample_replies(model, prompts, 6, {STOP}, temperature=1.0, generator=gen(3))
    assert a == sample_replies(model, prompts, 6, {STOP}, temperature=1.0, generator=gen(3))
    assert a != sample_replies(model, prompts, 6, {STOP}, temperature=1.0, generator=gen(4))
    together = sample_replies(model, prompts, 6, {STOP})
    assert together == [sample_replies(model, [p], 6, {STOP})[0] for p in prompts]
    assert all(len(r) <= 6 and (STOP not in r[:-1]) for r in a)


def test_rewards():
    assert exact_match(" 42\nmore", {"answer": "42", "task": "add"}, True) == 1.0
    assert exact_match("43", {"answer": "42", "task": "add"}, True) == 0.0
    assert exact_match("Yes", {"answer": "yes", "task": "compare"}, True) == 1.0  # the family's checker
    assert exact_match("Yes", {"answer": "yes"}, True) == 0.0  # no task: plain strings
    assert exact_match("  yes <|im_end|>", {"answer": "yes"}, True) == 1.0
    assert format_reward("42", {}, True) == 1.0
    assert format_reward("42", {}, False) == 0.0  # ran out of tokens
    assert format_reward("4\n2", {}, True) == 0.0 and format_reward(" ", {}, True) == 0.0
    total, parts = score_replies({"exact_match": 1.0, "format": 0.5}, ["42", "41\nx"],
                                 [{"answer": "42"}, {"answer": "41"}], [True, True])
    assert total.tolist() == [1.5, 1.0] and parts["format"].tolist() == [1.0, 0.0]


def _rollout(model, **cfg) -> Rollout:
    rl = RLConfig(**{"group_size": 4, "max_new_tokens": 5, "rewards": {"format": 1.0}, **cfg})
    def reference(ids, targets):  # the policy's log-probs minus 0.1 per completion token
        return token_logps(model(ids), targets) - 0.1 * (targets != IGNORE_INDEX)

    return Rollout(model, CharTokenizer(), {STOP}, rl, seq_len=64, reference=reference if rl.beta else None)


def test_rollout_rows_targets_and_group_advantages(model):
    prompts = PromptBatch(((5, 6, 7), (8, 9)), ({"answer": "1"}, {"answer": "2"}), seed=11)
    batch = _rollout(model)(prompts)
    assert batch.rows == 8 and batch.group_size == 4 and batch.ref_logps is None
    again = _rollout(model)(prompts)
    assert torch.equal(batch.input_ids, again.input_ids)  # the batch's seed fixes the samples
    for r in range(8):
        p = list(prompts.prompts[r // 4])
        row = batch.input_ids[r].tolist()
        assert row[: len(p)] == p
        t = batch.targets[r]
        done = (t != IGNORE_INDEX).nonzero().flatten().tolist()
        assert done[0] == len(p) - 1 and done == list(range(done[0], done[-1] + 1))
        assert t[done].tolist() == row[len(p) : len(p) + len(done)]  # each predicts the next token
    g = batch.rewards.view(2, 4)
    expect = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).flatten()
    assert torch.allclose(batch.advantages, expect, atol=1e-6)
    greedy = _rollout(model)(PromptBatch(prompts.prompts, prompts.info, greedy=True))
    assert greedy.rows == 2 and torch.equal(greedy.advantages, torch.zeros(2))
    with_ref = _rollout(model, beta=0.05)(prompts)
    assert with_ref.ref_logps is not None and with_ref.ref_logps.shape == with_ref.targets.shape


def test_rloo_kl_penalty_goes_into_the_reward(model):
    prompts = PromptBatch(((5, 6, 7),), ({"answer": "1"},), seed=3)
    batch = _rollout(model, algorithm="rloo", beta=0.5)(prompts)
    mask = batch.targets != IGNORE_INDEX
    # reference = policy - 0.1 per completion token: KL sum = 0.1 x tokens, in the reward before the baseline
    scored = batch.rewards - 0.5 * 0.1 * mask.sum(-1)
    loo = scored - (scored.sum() - scored) / 3
    assert torch.allclose(batch.advantages, loo, atol=1e-5)


def _batch(seed: int, rows: int = 4, width: int = 9) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (rows, width), generator=g)
    targets = torch.full((rows, width), IGNORE_INDEX)
    for r in range(rows):
        n = 1 + r % (width - 3)
        targets[r, 2 : 2 + n] = ids[r, 3 : 3 + n]
    rewards = torch.randint(0, 2, (rows,), generator=g).float()
    adv = torch.randn(rows, generator=g)
    return RolloutBatch(ids, targets, adv, rewards, group_size=2, reward_parts={"exact_match": rewards},
                        real_tokens=rows * width)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_rl_step_accumulation_equals_one_batch_and_metrics_are_per_completion(model, aggregation):
    obj = PolicyGradient(aggregation=aggregation, norm_length=8)
    parts = [_batch(1), _batch(2, rows=6, width=7)]
    whole = RolloutBatch(
        torch.cat([torch.nn.functional.pad(b.input_ids, (0, 9 - b.input_ids.size(1))) for b in parts]),
        torch.cat([torch.nn.functional.pad(b.targets, (0, 9 - b.targets.size(1)), value=IGNORE_INDEX)
                   for b in parts]),
        torch.cat([b.advantages for b in parts]), torch.cat([b.rewards for b in parts]), 2,
        reward_parts={"exact_match": torch.cat([b.rewards for b in parts])}, real_tokens=1)

    def grab(batches):  # the step's result and its gradients, caught before the (lr 0) update clears them
        captured = {}

        class Catch(torch.optim.SGD):
            def step(self, *a, **k):
                captured["g"] = [p.grad.clone() for p in model.parameters()]
                return super().step(*a, **k)

        model.zero_grad(set_to_none=True)
        opt = Catch(model.parameters(), lr=0.0)
        res = train_step(model, batches, opt, Precision("fp32", torch.device("cpu")), objective=obj)
        return res, captured["g"]

    r1, g1 = grab(parts)
    r2, g2 = grab([whole])
    assert r1.loss == pytest.approx(r2.loss, rel=1e-5, abs=1e-7)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    rewards = whole.rewards
    assert r1.metrics["reward"] == pytest.approx(float(rewards.mean()), rel=1e-6)
    tokens = (whole.targets != IGNORE_INDEX).sum()
    assert r1.metrics["completion_tokens"] == pytest.approx(float(tokens) / 10, rel=1e-6)
    assert r1.target_tokens == (int(tokens) if aggregation == "token-mean" else 10)


def test_ratio_one_loss_is_minus_mean_advantage(model):
    batch = _batch(4)
    obj = PolicyGradient(aggregation="seq-mean-token-mean")
    out = obj(model, batch)
    mean_loss = float(out.loss.detach()) / obj.num_targets(batch)
    assert mean_loss == pytest.approx(-float(batch.advantages.mean()), rel=1e-6)
    assert float(out.metrics["clip_fraction"]) == 0.0


def test_metric_sums_use_their_own_counts():
    sums = MetricSums()
    sums.add(ObjectiveOutput(torch.tensor(0.0), {"a": torch.tensor(3.0), "b": torch.tensor(4.0)},
                             {"a": torch.tensor(2.0)}))
    sums.add(ObjectiveOutput(torch.tensor(0.0), {"a": torch.tensor(1.0), "b": torch.tensor(2.0)},
                             {"a": torch.tensor(6.0)}))
    from lmforge.engine.comm import LOCAL

    means = sums.means(LOCAL, targets=3)
    assert means == {"a": pytest.approx(0.5), "b": pytest.approx(2.0)}
    assert math.isfinite(means["a"])


# ---- PPO ---------------------------------------------------------------------------------------------
def _completion_mask(starts, ends, width):
    pos = torch.arange(width)[None]
    return (pos >= torch.tensor(starts)[:, None]) & (pos < torch.tensor(ends)[:, None])


def test_gae_is_the_discounted_sum_of_td_errors_over_each_completion():
    from lmforge.engine.policy_loss import gae

    g = torch.Generator().manual_seed(0)
    mask = _completion_mask([2, 0, 4], [7, 3, 9], 9)
    rewards = torch.randn(3, 9, generator=g, dtype=torch.float64)
    values = torch.randn(3, 9, generator=g, dtype=torch.float64)
    for gamma, lam in ((1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)):
        adv, ret = gae(rewards, values, mask, gamma, lam)
        for r in range(3):
            idx = mask[r].nonzero().flatten().tolist()
            v = [float(values[r, t]) for t in idx] + [0.0]  # the episode ends after the last token
            deltas = [float(rewards[r, t]) + gamma * v[i + 1] - v[i] for i, t in enumerate(idx)]
            for i, t in enumerate(idx):
                want = sum((gamma * lam) ** k * d for k, d in enumerate(deltas[i:]))
                assert float(adv[r, t]) == pytest.approx(want, abs=1e-12)
                assert float(ret[r, t]) == pytest.approx(want + v[i], abs=1e-12)
        assert float(adv[~mask].abs().max()) == 0.0 and float(ret[~mask].abs().max()) == 0.0
    # lambda = 1, gamma = 1: the return is the sum of the rewards still to come
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    r0 = rewards[0, 2:7]
    torch.testing.assert_close(ret[0, 2:7], r0.flip(0).cumsum(0).flip(0), rtol=0, atol=1e-12)


def test_token_rewards_whiten_and_value_loss():
    from lmforge.engine.policy_loss import masked_whiten, token_rewards, value_losses

    mask = _completion_mask([1, 2], [4, 3], 5)
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5, 0.0], [0.0, 0.0, -3.0, 0.0, 0.0]])
    ref = old - 0.25
    r = token_rewards(torch.tensor([1.0, -2.0]), old, ref, mask, beta=0.4)
    want = torch.tensor([[0, -0.1, -0.1, -0.1 + 1.0, 0], [0, 0, -0.1 - 2.0, 0, 0]])
    torch.testing.assert_close(r, want)
    x = torch.tensor([[9.0, 1.0, 2.0, 3.0, 9.0], [9.0, 9.0, 6.0, 9.0, 9.0]])
    vals = torch.tensor([1.0, 2.0, 3.0, 6.0])
    w = masked_whiten(x, mask)
    torch.testing.assert_close(w[mask], (vals - vals.mean()) / (vals.var() + 1e-8).sqrt())
    assert float(w[~mask].abs().max()) == 0.0
    v, v_old = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.5, 0.5, 0.5])
    ret = torch.tensor([0.0, 1.0, 2.0])
    # clip 0.2: V moves at most 0.2 from V_old; the larger of the two squared errors counts (the third:
    # V = R exactly, but the clipped value 0.7 is 1.3 away)
    torch.testing.assert_close(value_losses(v, v_old, ret, 0.2), 0.5 * torch.tensor([1.0, 1.0, 1.3**2]))
    torch.testing.assert_close(value_losses(v, v_old, ret, None), 0.5 * (v - ret) ** 2)


def test_ppo_rollout_and_loss(model):
    from lmforge.models.transformer import add_head

    torch.manual_seed(1)
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, vocab_size=V)
    policy = build_model(cfg)
    add_head(policy, "value")
    rl = RLConfig(algorithm="ppo", group_size=1, max_new_tokens=5, rewards={"format": 1.0}, beta=0.1)
    roll = Rollout(policy, CharTokenizer(), {STOP}, rl, 64,
                   reference=lambda ids, t: token_logps(model(ids), t))
    batch = roll(PromptBatch(((5, 6, 7), (8, 9), (10, 11, 12)), ({"answer": "1"},) * 3, seed=4))
    mask = batch.completion_mask
    assert batch.advantages.shape == mask.shape and batch.returns.shape == mask.shape
    assert float(batch.advantages[mask].mean()) == pytest.approx(0.0, abs=1e-6)  # whitened
    obj = PolicyGradient(algorithm="ppo", aggregation="token-mean", vf_coef=0.5, cliprange_value=0.2)
    obj.check_model(policy)
    out = obj(policy, batch)
    # ratio 1 and values equal to the sampling-time ones: -A + 0.5 x 0.5 (V - R)^2 per token
    hidden = policy(batch.input_ids, head=lambda h, w: h)
    values = policy.value(hidden).squeeze(-1)
    want = (-batch.advantages + 0.25 * (values - batch.returns) ** 2)[mask].sum()
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(values[mask].detach(), batch.old_values[mask], rtol=1e-5, atol=1e-6)
    assert set(out.metrics) >= {"value_loss", "value", "returns", "kl", "reward"}
    with pytest.raises(Exception, match="value head"):
        obj.check_model(model)
