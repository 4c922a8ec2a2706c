"""The preference objective on a real (tiny) model: padded, batched log-probs equal each sequence
alone; DPO at policy = reference is ln 2 per pair; the reference is the base with adapters off;
accumulation equals one big batch; PreferenceBatch / PreferenceLoader keep chosen rows first and
resume exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.data.batch import IGNORE_INDEX, PreferenceBatch
from lmforge.data.chat_loader import PreferenceLoader
from lmforge.data.sft import Example, SFTSplit
from lmforge.engine.objectives import OBJECTIVES, Preference
from lmforge.engine.objectives.preference import completion_logps
from lmforge.engine.precision import Precision
from lmforge.engine.step import train_step
from lmforge.errors import ConfigError
from lmforge.finetune.lora import adapters_disabled, apply_lora
from lmforge.models import build_model

V = 61


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                      norm="rmsnorm", pos_embedding="rope", mlp="swiglu", bias=False, dropout=0.0)
    return build_model(cfg)


def examples(n_pairs: int, seed: int) -> list[Example]:
    """2 n_pairs examples (chosen, rejected, chosen, ...): a prompt of 3-6 tokens, a completion of 1-5."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2 * n_pairs):
        p, c = int(rng.integers(3, 7)), int(rng.integers(1, 6))
        ids = rng.integers(0, V, p + c).astype(np.int32)
        out.append(Example(ids, np.r_[np.zeros(p, bool), np.ones(c, bool)]))
    return out


def loader(n_pairs: int, batch: int, seed: int = 0, **kw) -> PreferenceLoader:
    return PreferenceLoader(SFTSplit.of(examples(n_pairs, seed)), 16, batch, seed=seed, **kw)


def test_batched_completion_logps_equal_each_sequence_alone():
    model = tiny_model().eval()
    load = loader(6, 6, shuffle=False)
    batch = next(iter(load))
    logps, counts = completion_logps(model, batch)
    order = [0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11]  # chosen rows first, then the rejected ones
    for row, i in enumerate(order):
        ids, mask = load.split.example(i)
        x = torch.as_tensor(ids, dtype=torch.long)[None]
        logp = torch.log_softmax(model(x)[0, :-1].float(), -1).gather(1, x[0, 1:, None])[:, 0]
        want = logp[torch.as_tensor(mask[1:])].sum()
        torch.testing.assert_close(logps[row], want, rtol=1e-5, atol=1e-5)
        assert counts[row] == int(mask[1:].sum())
    assert batch.real_tokens == int(load.split.lengths.sum())


def test_dpo_starts_at_ln2_with_the_base_as_reference_and_learns():
    model = tiny_model()
    apply_lora(model, ["all-linear"], r=4, alpha=8.0)  # B = 0: the policy is the base at step 0

    def reference(batch):
        with adapters_disabled(model):
            return completion_logps(model, batch)[0]

    objective = Preference("sigmoid", beta=0.5, reference=reference)
    assert OBJECTIVES["dpo"] is Preference
    load = loader(8, 8)
    batch = objective.batch_of(next(iter(load)))
    assert batch.ref_logps is not None and objective.num_targets(batch) == 8
    out = objective(model, batch)
    torch.testing.assert_close(out.loss, torch.tensor(8 * math.log(2.0)), rtol=1e-6, atol=0)
    assert out.metrics["reward_accuracy"].item() == 0.0 and out.metrics["reward_margin"].item() == 0.0
    assert out.metrics["ref_logp_accuracy"] == out.metrics["logp_accuracy"]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    first = None
    for _ in range(30):
        result = train_step(model, [batch], opt, Precision("fp32", torch.device("cpu")), objective=objective)
        first = first if first is not None else result
    assert first.loss == pytest.approx(math.log(2.0), rel=1e-6)
    after = objective(model, objective.batch_of(batch))
    assert after.loss.item() / 8 < 0.3 and after.metrics["reward_accuracy"].item() == 8.0


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo", "orpo"])
def test_accumulated_micro_batches_equal_one_big_batch(loss):
    """The step divides by the pairs of the whole step: two micro-batches of 3 and 5 pairs give the
    loss and gradients of one batch of 8 (padding widths differ between them, too)."""
    load = loader(8, 8, shuffle=False)
    big = next(iter(load))
    small = [load.collate(load.units[:3]), load.collate(load.units[3:])]
    ref = torch.randn(16, generator=torch.Generator().manual_seed(3)) - 10
    with_ref = lambda b, idx: PreferenceBatch(b.input_ids, b.targets, ref[idx], b.real_tokens)  # noqa: E731
    big = with_ref(big, list(range(16)))
    small = [with_ref(small[0], [0, 1, 2, 8, 9, 10]),
             with_ref(small[1], [3, 4, 5, 6, 7, 11, 12, 13, 14, 15])]
    grads, losses = [], []
    for batches in ([big], small):
        model = tiny_model()
        opt = _Capture(model.parameters(), lr=0.0)
        res = train_step(model, batches, opt, Precision("fp32", torch.device("cpu")),
                         objective=Preference(loss, beta=0.3))
        losses.append(res.loss)
        grads.append(opt.captured)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert grads[0].abs().max() > 1e-3


class _Capture(torch.optim.SGD):
    """SGD that keeps the gradients it was handed (the step zeroes them afterwards)."""

    def step(self, closure=None):
        self.captured = torch.cat([p.grad.flatten() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def test_a_reference_loss_without_a_reference_is_a_config_error():
    batch = next(iter(loader(2, 2)))
    with pytest.raises(ConfigError, match="reference model"):
        Preference("sigmoid")(tiny_model(), batch)
    out = Preference("simpo")(tiny_model(), batch)  # reference-free
    assert torch.isfinite(out.loss) and "ref_logp_accuracy" not in out.metrics
    with pytest.raises(ConfigError, match="not one of"):
        Preference("kto-ish")


def test_preference_batch_cat_keeps_chosen_rows_first():
    ignore = lambda w: torch.full((2, w), IGNORE_INDEX)  # noqa: E731
    a = PreferenceBatch(torch.tensor([[1, 1], [2, 2]]), ignore(2), torch.tensor([1.0, 2.0]), 4)
    b = PreferenceBatch(torch.tensor([[3], [4]]), ignore(1), torch.tensor([3.0, 4.0]), 2)
    c = PreferenceBatch.cat([a, b])
    assert c.input_ids.tolist() == [[1, 1], [3, 0], [2, 2], [4, 0]] and c.pairs == 2 and c.real_tokens == 6
    assert c.ref_logps.tolist() == [1.0, 3.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="odd"):
        PreferenceBatch(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2, dtype=torch.long))


def test_preference_loader_shuffles_pairs_and_resumes_exactly():
    load = loader(10, 3, seed=4)
    batches = [load.next_batch() for _ in range(5)]
    for b in batches:
        p = b.pairs
        assert p == 3
        for i in range(p):  # every row has completion targets
            assert b.targets[i].ne(IGNORE_INDEX).any() and b.targets[p + i].ne(IGNORE_INDEX).any()
    order = [int(u) for u in load._rank_units(0)]
    assert sorted(order) == list(range(10)) and order != list(range(10))  # pairs shuffled as units
    first = load.collate([load.units[u] for u in order[:3]])
    assert torch.equal(first.input_ids, batches[0].input_ids)
    again = loader(10, 3, seed=4)
    again.next_batch()
    again.next_batch()
    state = again.state_dict()
    resumed = loader(10, 3, seed=4)
    resumed.load_state_dict(state)
    for want in batches[2:]:
        got = resumed.next_batch()
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.targets, want.targets)
    with pytest.raises(Exception, match="pairs"):
        PreferenceLoader(SFTSplit.of(examples(2, 0)[:3]), 16, 1)


def test_adapters_disabled_also_restores_trainable_token_rows():
    from lmforge.finetune.token_rows import train_token_rows

    base = tiny_model()
    x = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(5))
    want = base(x).detach()
    model = tiny_model()
    model.requires_grad_(False)
    apply_lora(model, ["all-linear"], r=4, alpha=8.0)
    train_token_rows(model, [3, 7])
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.5)  # the adapters and the token rows have trained away from the base
    assert not torch.allclose(model(x), want, atol=1e-3)
    with adapters_disabled(model):
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)


def test_sft_weight_adds_the_chosen_token_mean_nll():
    batch = next(iter(loader(3, 3)))
    batch = PreferenceBatch(batch.input_ids, batch.targets, torch.zeros(6) - 5.0, batch.real_tokens)
    model = tiny_model()
    plain = Preference("sigmoid", beta=0.2)(model, batch).loss
    rpo = Preference("sigmoid", beta=0.2, sft_weight=0.7)(model, batch).loss
    logps, counts = completion_logps(model, batch)
    nll = -(logps[:3] / counts[:3]).sum()
    torch.testing.assert_close(rpo, plain + 0.7 * nll, rtol=1e-6, atol=1e-6)
    assert nll > 1.0  # the term is far above rounding


def test_unpaired_loader_builds_mismatched_twins_and_kto_uses_them():
    """Example i's twin is its prompt + example i-1's completion; KTO's z comes from the twins only."""
    from lmforge.data.chat_loader import UnpairedLoader
    from lmforge.engine.objectives.preference import KTO
    from lmforge.engine.preference_loss import kto_losses, kto_reference_point, sequence_logps

    rng = np.random.default_rng(3)
    exs = []
    for i in range(6):
        p, c = 2 + i % 3, 1 + i % 2
        ids = rng.integers(2, 60, p + c).astype(np.int32)
        exs.append(Example(ids, np.r_[np.zeros(p, bool), np.ones(c, bool)]))
    split = SFTSplit.of(exs)
    labels = [True, False, True, True, False, False]
    batch = UnpairedLoader(split, labels, 32, 3, shuffle=False).next_batch()
    assert batch.rows == 6 and batch.desirable.tolist() == labels[:3]
    for i in range(3):
        x, m = split.example(i)
        prev_x, prev_m = split.example((i - 1) % 3)
        want = np.r_[x[~m], prev_x[prev_m]]
        row = batch.input_ids[3 + i, : len(want)].numpy()
        assert (row == want).all()
        t = batch.targets[3 + i]
        assert (t != IGNORE_INDEX).sum() == prev_m.sum()  # the twin's loss is on the borrowed completion
    model = tiny_model(1)
    ref = lambda b: completion_logps(tiny_model(2), b)[0]  # noqa: E731
    obj = KTO(beta=0.3, desirable_weight=1.0, undesirable_weight=1.5, reference=ref)
    b = obj.batch_of(batch)
    out = obj(model, b)
    logps, _ = sequence_logps(model(b.input_ids), b.targets)
    z = kto_reference_point(logps[3:], b.ref_logps[3:])
    want, _ = kto_losses(logps[:3], b.ref_logps[:3], b.desirable, z, beta=0.3, undesirable_weight=1.5)
    torch.testing.assert_close(out.loss, want.sum(), rtol=1e-6, atol=1e-7)
    assert obj.num_targets(b) == 3 and float(out.metrics["kl"]) == pytest.approx(float(z))
