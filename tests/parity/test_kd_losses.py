"""Distillation losses against their references: TRL's `GKDTrainer.generalized_jsd_loss` (values, every
beta and temperature) and torchtune's ForwardKLLoss / ReverseKLLoss (gradients: torchtune's forward
"KL" is the cross-entropy with the teacher, the KL minus the teacher's entropy, a constant for the
student, so values differ by that entropy and gradients agree). TRL in float64, tolerance 1e-12;
torchtune casts its softmaxes to float32 whatever the input, so that comparison runs in float32 with a
float32 tolerance (rtol 1e-5, atol 1e-7).

torchtune's package imports torchao and its dataset stack; kd_losses.py imports only torch, so the
file is loaded on its own.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmforge.engine.kd_loss import kd_divergence, kd_loss_sum, topk_forward_kl_sum

trl_gkd = pytest.importorskip("trl.experimental.gkd")
TOL = dict(rtol=1e-12, atol=1e-12)
TOL32 = dict(rtol=1e-5, atol=1e-7)


def _torchtune_kd():
    spec = importlib.util.find_spec("torchtune")
    if spec is None or spec.origin is None:
        pytest.skip("torchtune is not installed")
    path = Path(spec.origin).parent / "modules" / "loss" / "kd_losses.py"
    s = importlib.util.spec_from_file_location("torchtune_kd_losses", path)
    module = importlib.util.module_from_spec(s)
    s.loader.exec_module(module)
    return module


def _case(seed: int = 0, B: int = 3, T: int = 7, V: int = 50):
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    teacher = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :2] = -100
    labels[2, -3:] = -100
    return student, teacher, labels


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalised_jsd_equals_trl_per_token_and_batchmean(beta, temperature):
    student, teacher, labels = _case()
    gkd = trl_gkd.GKDTrainer.generalized_jsd_loss
    loss = "jsd"
    # reduction "none" keeps TRL's elementwise terms (position, token): summed over the vocabulary
    ref = gkd(student, teacher, labels=labels, beta=beta, temperature=temperature, reduction="none").sum(-1)
    ours = kd_divergence(student, teacher, loss, temperature, beta)[labels != -100]
    torch.testing.assert_close(ours.double(), ref.double(), **TOL)
    # summed over targets and scaled by T^2 (Hinton): TRL's batchmean times targets times T^2
    n = int((labels != -100).sum())
    ref_mean = gkd(student, teacher, labels=labels, beta=beta, temperature=temperature)
    total = kd_loss_sum(student, teacher, labels != -100, loss, temperature, beta)
    torch.testing.assert_close(total.double(), ref_mean.double() * n * temperature**2, **TOL)


@pytest.mark.parametrize("name,beta", [("forward_kl", 0.0), ("reverse_kl", 1.0)])
def test_named_kls_are_the_jsd_endpoints(name, beta):
    student, teacher, _ = _case(1)
    a = kd_divergence(student, teacher, name, 1.5)
    b = trl_gkd.GKDTrainer.generalized_jsd_loss(student, teacher, beta=beta, temperature=1.5,
                                                reduction="none").sum(-1)
    torch.testing.assert_close(a.double(), b.double(), **TOL)


@pytest.mark.parametrize("name,cls", [("forward_kl", "ForwardKLLoss"), ("reverse_kl", "ReverseKLLoss")])
def test_gradients_equal_torchtune(name, cls):
    kd = _torchtune_kd()
    student, teacher, labels = _case(2)
    student = student.detach().float().requires_grad_(True)
    teacher = teacher.float()
    mask = labels != -100
    ours = kd_loss_sum(student, teacher, mask, name) / mask.sum()
    (g_ours,) = torch.autograd.grad(ours, student)
    V = student.shape[-1]
    ref = getattr(kd, cls)()(student.view(-1, V), teacher.view(-1, V), labels.view(-1))
    (g_ref,) = torch.autograd.grad(ref, student)
    torch.testing.assert_close(g_ours, g_ref, **TOL32)
    if name == "forward_kl":  # values: torchtune's cross-entropy = our KL + the teacher's entropy
        p = F.softmax(teacher, -1)
        entropy = -(p * p.log()).sum(-1)[mask].mean()
        torch.testing.assert_close(ref.detach(), ours.detach() + entropy, **TOL32)
    else:
        torch.testing.assert_close(ref.detach(), ours.detach(), **TOL32)


def test_topk_with_the_whole_vocabulary_is_the_full_forward_kl():
    student, teacher, labels = _case(3, V=20)
    mask = labels != -100
    T = 1.3
    top = teacher.topk(20, dim=-1)
    lse = torch.logsumexp(teacher / T, -1)
    full = kd_loss_sum(student, teacher, mask, "forward_kl", T)
    sparse = topk_forward_kl_sum(student, top.indices, top.values, lse, mask, T)
    torch.testing.assert_close(sparse, full, **TOL)


def test_topk_merges_the_tail_into_one_outcome_and_bounds_the_kl():
    student, teacher, labels = _case(4, V=40)
    mask = labels != -100
    k = 5
    top = teacher.topk(k, dim=-1)
    lse = torch.logsumexp(teacher, -1)
    sparse = topk_forward_kl_sum(student, top.indices, top.values, lse, mask)
    # the same KL written out over the k + 1 outcomes (top-k tokens, everything else)
    p, q = F.softmax(teacher, -1), F.softmax(student, -1)
    p_k, q_k = p.gather(-1, top.indices), q.gather(-1, top.indices)
    p_c = torch.cat([p_k, 1 - p_k.sum(-1, keepdim=True)], -1)
    q_c = torch.cat([q_k, 1 - q_k.sum(-1, keepdim=True)], -1)
    expect = (p_c * (p_c.log() - q_c.log())).sum(-1)[mask].sum()
    torch.testing.assert_close(sparse, expect, **TOL)
    assert sparse < kd_loss_sum(student, teacher, mask, "forward_kl")  # merging outcomes lowers a KL
