"""The reward model's Bradley-Terry loss against TRL's RewardTrainer.compute_loss, fed the same rewards
(float64, so the comparison at 1e-12 shows the formulas, not rounding; a float32 run checks 1e-6).

TRL's compute_loss reads settings from the trainer, calls the model and logs through its accelerator:
it is called here unbound, on a stand-in holding exactly the attributes it reads, with a model
stand-in returning the given rewards as logits (2P, 1), chosen rows first (TRL chunks them in two).
Compared: the loss with and without per-pair margins and reward centring, its gradients with respect
to the rewards, and the accuracy and margin TRL logs. Then the objective end to end on a tiny lmforge
Transformer with a score head (right-padded pairs of different lengths): RewardModel's loss and
metrics against TRL's from `sequence_scores`, the last positions, the scores against the hidden
states read by hand; and the same model exported as a Hugging Face dir, loaded by transformers as
LlamaForSequenceClassification and run as TRL's model, whose pooled logits and loss must agree.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

from trl.trainer.reward_trainer import RewardTrainer  # noqa: E402

from lmforge.config.schema import ModelConfig  # noqa: E402
from lmforge.data.batch import IGNORE_INDEX, PreferenceBatch  # noqa: E402
from lmforge.engine.objectives.reward import (  # noqa: E402
    RewardModel,
    bradley_terry,
    last_positions,
    sequence_scores,
)
from lmforge.models import build_model  # noqa: E402

P = 6  # pairs
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-6, atol=1e-6)}
APPROX = {dtype: dict(rel=t["rtol"], abs=t["atol"]) for dtype, t in TOL.items()}  # pytest.approx's names


class _Accelerator:
    device = torch.device("cpu")

    @staticmethod
    def gather(t):
        return t

    gather_for_metrics = gather


def _trainer(center: float | None) -> SimpleNamespace:
    """What RewardTrainer.compute_loss reads from `self`."""
    return SimpleNamespace(
        model=SimpleNamespace(training=True), args=SimpleNamespace(center_rewards_coefficient=center),
        accelerator=_Accelerator(), _total_train_tokens=0, _tp_size=1,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )


def _model(chosen: torch.Tensor, rejected: torch.Tensor):
    """A stand-in for the sequence-classification model: the rewards as its logits (2P, 1)."""

    def call(**kwargs):
        return SimpleNamespace(logits=torch.cat([chosen, rejected]).unsqueeze(-1))

    return call


def _trl(chosen, rejected, margin=None, center=None, attention_mask=None, model=None):
    """TRL's loss and the trainer stand-in (holding its metrics)."""
    trl_self = _trainer(center)
    if attention_mask is None:
        attention_mask = torch.ones(2 * chosen.size(0), 4, dtype=torch.long)
    inputs = dict(attention_mask=attention_mask)
    if margin is not None:
        inputs["margin"] = margin
    loss = RewardTrainer.compute_loss(trl_self, model or _model(chosen, rejected), inputs)
    return loss, trl_self


def _rewards(dtype: torch.dtype, seed: int):
    """Leaf rewards (P,) of both sides, one pair tied (accuracy counts strict wins only), and margins."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randn(P, generator=g, dtype=torch.float64) * 3
    rejected = torch.randn(P, generator=g, dtype=torch.float64) * 3
    rejected[2] = chosen[2]
    margin = torch.rand(P, generator=g, dtype=torch.float64) * 2
    return (chosen.to(dtype).requires_grad_(), rejected.to(dtype).requires_grad_(), margin.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.0, 0.01])
def test_bradley_terry_equals_trl_reward_trainer(dtype, with_margin, center):
    chosen, rejected, margin = _rewards(dtype, seed=1)
    margin = margin if with_margin else None
    theirs, trl_self = _trl(chosen, rejected, margin, center)
    their_grads = torch.autograd.grad(theirs, [chosen, rejected])

    ours = bradley_terry(chosen, rejected, margin, 0.0 if center is None else center)
    assert ours.shape == (P,)
    torch.testing.assert_close(ours.mean(), theirs, **TOL[dtype])
    for a, b in zip(torch.autograd.grad(ours.mean(), [chosen, rejected]), their_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype])

    # the metrics RewardModel sums, per pair, against what TRL logs
    c, r = chosen.detach(), rejected.detach()
    metrics = trl_self._metrics["train"]
    accuracy = (c > r).float().sum().item() / P
    assert accuracy == pytest.approx(metrics["accuracy"][0], rel=1e-7)  # TRL's mean is fp32
    assert accuracy < 1.0  # the tied pair is not counted (chosen == rejected)
    assert (c - r).sum().item() / P == pytest.approx(metrics["margin"][0], **APPROX[dtype])


def test_center_term_and_margin_worked_by_hand():
    chosen = torch.tensor([1.0, -2.0], dtype=torch.float64)
    rejected = torch.tensor([0.5, 1.0], dtype=torch.float64)
    margin = torch.tensor([0.25, 0.0], dtype=torch.float64)
    diff = torch.tensor([0.25, -3.0], dtype=torch.float64)
    want = torch.log1p(torch.exp(-diff)) + 0.1 * torch.tensor([1.5**2, 1.0], dtype=torch.float64)
    torch.testing.assert_close(bradley_terry(chosen, rejected, margin, 0.1), want, rtol=1e-14, atol=1e-14)


# ------------------------------------------------------------------------------ end to end

VOCAB, T = 50, 14
# (prompt, completion) lengths per row: chosen rows 0..P-1, then rejected; one fills the width, one has a
# completion of a single token
LENGTHS = [(3, 5), (2, 12), (5, 1), (4, 6), (6, 3), (2, 2),
           (3, 2), (2, 7), (5, 4), (4, 10), (6, 1), (3, 8)]


def _tiny_model(tie: bool = True):
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                                    vocab_size=VOCAB, score_head=True, tie_embeddings=tie))
    with torch.no_grad():  # scores of order 1 rather than the init's 0.02 scale
        model.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    return model


def _batch(seed: int = 2) -> tuple[PreferenceBatch, torch.Tensor, torch.Tensor]:
    """Right-padded pairs (pad id 0, never a real token), targets the next token on the completion;
    also the attention mask and each row's length."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(2 * P, T, dtype=torch.long)
    targets = torch.full((2 * P, T), IGNORE_INDEX, dtype=torch.long)
    lengths = torch.tensor([p + c for p, c in LENGTHS])
    assert lengths.max() == T
    for i, (p, c) in enumerate(LENGTHS):
        n = p + c
        ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        targets[i, p - 1 : n - 1] = ids[i, p:n]  # last target at n - 2
    mask = (torch.arange(T) < lengths[:, None]).long()
    margins = torch.rand(P, generator=g) * 0.5
    batch = PreferenceBatch(ids, targets, real_tokens=int(mask.sum()), margins=margins)
    return batch, mask, lengths


def test_last_positions_are_each_rows_last_token():
    batch, mask, lengths = _batch()
    assert torch.equal(last_positions(batch.targets), lengths - 1)
    assert torch.equal(last_positions(batch.targets), mask.sum(-1) - 1)


def test_sequence_scores_equal_the_score_head_at_the_last_token():
    model = _tiny_model()
    batch, _, lengths = _batch()
    with torch.no_grad():
        hidden = model(batch.input_ids, head=lambda h, w: h)  # (2P, T, d_model)
        want = model.score(hidden[torch.arange(2 * P), lengths - 1]).squeeze(-1)
        got = sequence_scores(model, batch.input_ids, batch.targets)
    assert got.shape == (2 * P,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got.abs().max() > 0.5  # order-1 scores: the comparisons below are not vacuous


@pytest.mark.parametrize("center", [0.0, 0.01])
def test_reward_model_objective_equals_trl_on_sequence_scores(center):
    model = _tiny_model()
    batch, mask, _ = _batch()
    params = [p for p in model.parameters() if p.requires_grad]

    out = RewardModel(center_coefficient=center)(model, batch)
    ours = out.loss / P
    our_grads = torch.autograd.grad(ours, params)

    scores = sequence_scores(model, batch.input_ids, batch.targets)
    theirs, trl_self = _trl(scores[:P], scores[P:], batch.margins, center if center else None, mask)
    their_grads = torch.autograd.grad(theirs, params)

    torch.testing.assert_close(ours, theirs, **TOL[torch.float32])
    for a, b in zip(our_grads, their_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    metrics = trl_self._metrics["train"]
    assert out.metrics["accuracy"].item() / P == pytest.approx(metrics["accuracy"][0], rel=1e-7)
    assert out.metrics["margin"].item() / P == pytest.approx(metrics["margin"][0], **APPROX[torch.float32])
    s = scores.detach()
    torch.testing.assert_close(out.metrics["reward_chosen"], s[:P].sum(), **TOL[torch.float32])
    torch.testing.assert_close(out.metrics["reward_rejected"], s[P:].sum(), **TOL[torch.float32])
    assert trl_self._total_train_tokens == batch.real_tokens
    assert RewardModel().num_targets(batch) == P


@pytest.mark.parametrize("tie", [True, False])
def test_exported_model_is_transformers_sequence_classifier_with_the_same_scores(tmp_path, tie):
    transformers = pytest.importorskip("transformers")
    from lmforge.models.hf.convert import to_hf

    model = _tiny_model(tie)
    batch, mask, _ = _batch()
    to_hf(model, tmp_path, pad_token_id=0)
    hf, info = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path,
                                                                               output_loading_info=True)
    assert type(hf).__name__ == "LlamaForSequenceClassification"
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == 0
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    hf.eval()
    with torch.no_grad():
        ours = sequence_scores(model, batch.input_ids, batch.targets)
        theirs = hf(input_ids=batch.input_ids, attention_mask=mask).logits
        assert theirs.shape == (2 * P, 1)
        torch.testing.assert_close(theirs[:, 0], ours, rtol=1e-5, atol=1e-5)

        # TRL's compute_loss with transformers' model itself as the model
        trl_self = _trainer(0.01)
        inputs = dict(input_ids=batch.input_ids, attention_mask=mask, margin=batch.margins)
        trl_loss = RewardTrainer.compute_loss(trl_self, hf, inputs)
        our_loss = RewardModel(center_coefficient=0.01)(model, batch).loss / P
    torch.testing.assert_close(our_loss, trl_loss, rtol=1e-5, atol=1e-5)
