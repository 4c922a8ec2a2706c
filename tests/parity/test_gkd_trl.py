"""Objective gkd against TRL's `GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels,
beta, temperature, reduction="batchmean")`: on random logits (float64 to 1e-12, float32 to 1e-6) and on
two tiny models' real logits through the objective itself (its summed loss over its target count), for
beta 0, 0.5 and 1 at temperatures other than 1, with ignored positions; and split into micro-batches,
whose sums over the step's count are TRL's batchmean of the whole batch (gradient accumulation)."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.data.batch import IGNORE_INDEX, ChatBatch
from lmforge.engine.loss import logits_of
from lmforge.engine.objectives.gkd import GKD, gkd_loss_sum
from lmforge.models import Transformer

trl_gkd = pytest.importorskip("trl.experimental.gkd")
trl_jsd = trl_gkd.GKDTrainer.generalized_jsd_loss
CASES = [(0.0, 0.7), (0.5, 0.9), (1.0, 2.0), (0.5, 1.3), (0.2, 0.5)]
V = 40


def _labels(B: int, T: int, g: torch.Generator) -> torch.Tensor:
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, :3] = IGNORE_INDEX  # a prompt
    labels[torch.rand(B, T, generator=g) < 0.2] = IGNORE_INDEX  # padding and other ignored positions
    return labels


@pytest.mark.parametrize("beta,temperature", CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_the_loss_is_trls_batchmean_on_random_logits(beta, temperature, dtype, tol):
    g = torch.Generator().manual_seed(int(beta * 10 + temperature * 100))
    student = (3 * torch.randn(3, 11, V, generator=g)).to(dtype)
    teacher = (3 * torch.randn(3, 11, V, generator=g)).to(dtype)
    labels = _labels(3, 11, g)
    ours = gkd_loss_sum(student, teacher, labels, beta, temperature) / (labels != IGNORE_INDEX).sum()
    theirs = trl_jsd(student, teacher, labels, beta=beta, temperature=temperature, reduction="batchmean")
    assert ours.item() == pytest.approx(theirs.item(), abs=tol, rel=tol)


def _tiny(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                   max_seq_len=32, tie_embeddings=False, init_std=0.1)).double()


@pytest.mark.parametrize("beta,temperature", CASES)
def test_the_objective_on_real_logits_is_trls_batchmean(beta, temperature):
    student, teacher = _tiny(0), _tiny(1).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (4, 16), generator=g)
    targets = _labels(4, 16, g)
    batch = ChatBatch(ids, targets, real_tokens=ids.numel())
    objective = GKD(beta=beta, temperature=temperature, lmbda=0.0, packing=False)
    objective.teacher = lambda b: logits_of(teacher(b.input_ids))
    out = objective(student, batch)
    ours = out.loss / objective.num_targets(batch)
    with torch.no_grad():
        s_logits, t_logits = logits_of(student(ids)), logits_of(teacher(ids))
    theirs = trl_jsd(s_logits, t_logits, targets, beta=beta, temperature=temperature, reduction="batchmean")
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-10, rel=1e-10)
    assert ours.item() > 0  # two different models: a divergence to learn from
    ce = torch.nn.functional.cross_entropy(s_logits.reshape(-1, V), targets.reshape(-1), reduction="sum")
    assert out.metrics["ce"].item() == pytest.approx(ce.item(), rel=1e-6)  # summed in float32
    assert out.metrics["on_policy"].item() == 0.0

    # gradient accumulation: each micro-batch's sum over the step's count adds up to the whole batchmean
    halves = [ChatBatch(ids[i:i + 2], targets[i:i + 2], real_tokens=32) for i in (0, 2)]
    n = sum(objective.num_targets(h) for h in halves)
    split = sum(objective(student, h).loss for h in halves) / n
    assert split.item() == pytest.approx(theirs.item(), abs=1e-10, rel=1e-10)


def test_the_gradient_is_trls():
    student, teacher = _tiny(0), _tiny(1).eval()
    g = torch.Generator().manual_seed(5)
    ids, targets = torch.randint(0, V, (2, 12), generator=g), _labels(2, 12, g)
    objective = GKD(beta=0.5, temperature=0.9, lmbda=0.0, packing=False)
    objective.teacher = lambda b: logits_of(teacher(b.input_ids))
    batch = ChatBatch(ids, targets, real_tokens=ids.numel())
    (objective(student, batch).loss / objective.num_targets(batch)).backward()
    ours = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    with torch.no_grad():
        t_logits = logits_of(teacher(ids))
    trl_jsd(logits_of(student(ids)), t_logits, targets, beta=0.5, temperature=0.9).backward()
    for a, b in zip(ours, (p.grad for p in student.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
