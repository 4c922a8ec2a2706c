"""The optimizer step: accumulation equals one big batch, loss normalised by real target tokens,
activation checkpointing changes nothing, mixed precision and non-finite gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.config.optim import optim_config
from lmforge.data.batch import IGNORE_INDEX
from lmforge.engine.precision import Precision
from lmforge.engine.step import Verdict, train_step
from lmforge.models import build_model
from lmforge.optim.builder import build_optimizer, param_groups
from lmforge.parallel.checkpointing import apply_activation_checkpointing

CPU = torch.device("cpu")


def make(seed: int = 0, sgd: bool = False, **model_kw):
    """A debug model and its optimizer. With sgd=True (lr 1) the update equals the gradient, which
    compares gradients directly: Adam's first step divides by |g|, so it amplifies float rounding
    in near-zero gradient entries and is the wrong place to compare two gradient computations."""
    torch.manual_seed(seed)
    cfg = ModelConfig(preset="debug", vocab_size=97, max_seq_len=32, **model_kw)
    model = build_model(cfg)
    if sgd:
        return model, torch.optim.SGD(model.parameters(), lr=1.0)
    return model, build_optimizer(model, optim_config(lr=1e-2, weight_decay=0.1))


def batch(n: int, t: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 97, (n, t), generator=g)
    y = torch.randint(0, 97, (n, t), generator=g)
    return x, y


def max_param_diff(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_equals_one_big_batch(k):
    x, y = batch(8)
    # Uneven ignore masks: micro-batches carry different numbers of real targets.
    y = y.clone()
    y[0, :10] = IGNORE_INDEX
    y[5, 3:] = IGNORE_INDEX
    big, opt_big = make(sgd=True)
    acc, opt_acc = make(sgd=True)
    r_big = train_step(big, [(x, y)], opt_big, Precision("fp32", CPU), grad_clip=0.0)
    micro = [(x[i:i + 8 // k], y[i:i + 8 // k]) for i in range(0, 8, 8 // k)]
    r_acc = train_step(acc, micro, opt_acc, Precision("fp32", CPU), grad_clip=0.0)
    assert r_acc.target_tokens == r_big.target_tokens == int((y != IGNORE_INDEX).sum())
    assert r_acc.loss == pytest.approx(r_big.loss, abs=1e-6)
    assert r_acc.grad_norm == pytest.approx(r_big.grad_norm, rel=1e-5)
    assert max_param_diff(big, acc) < 1e-6


def test_normalising_by_microbatch_count_would_differ():
    """Guard that the test above can fail: averaging per-micro-batch means is not the same gradient."""
    x, y = batch(4)
    y = y.clone()
    y[:2, 2:] = IGNORE_INDEX  # first micro-batch has far fewer targets
    model, _ = make()
    ref = copy.deepcopy(model)
    ce = torch.nn.functional.cross_entropy
    per_micro = sum(ce(model(x[i:i + 2]).view(-1, 97), y[i:i + 2].view(-1)) for i in (0, 2)) / 2
    per_micro.backward()
    whole = ce(ref(x).view(-1, 97), y.view(-1))
    whole.backward()
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    assert diff > 1e-4


def test_clipping_logs_norm_before_clip_and_bounds_update():
    x, y = batch(4)
    model, opt = make()
    r = train_step(model, [(x, y)], opt, Precision("fp32", CPU), grad_clip=1e-3)
    assert r.grad_norm > 1e-3  # the reported norm is the pre-clip one


def test_param_groups_exclude_norms_biases_embeddings_from_decay():
    model, _ = make(bias=True)
    groups = {g["name"]: g for g in param_groups(model, 0.1)}
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for p in groups["no_decay"]["params"]}
    decay = {names[id(p)] for p in groups["decay"]["params"]}
    assert "tok_embeddings.weight" in no_decay and "norm.weight" in no_decay
    assert any(n.endswith("attn.wq.bias") for n in no_decay)
    assert all(n.endswith(".weight") and "norm" not in n and "embeddings" not in n for n in decay)
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0


@pytest.mark.parametrize("mode", ["full", "every_k"])
def test_activation_checkpointing_gives_identical_gradients(mode):
    x, y = batch(4)
    plain, opt_plain = make()
    ckpt, opt_ckpt = make()
    keys_before = list(ckpt.state_dict())
    wrapped = apply_activation_checkpointing(ckpt, mode, every=2)
    assert wrapped == (2 if mode == "full" else 1)
    assert list(ckpt.state_dict()) == keys_before  # checkpoints do not depend on the wrapper
    r1 = train_step(plain, [(x, y)], opt_plain, Precision("fp32", CPU), grad_clip=1.0)
    r2 = train_step(ckpt, [(x, y)], opt_ckpt, Precision("fp32", CPU), grad_clip=1.0)
    assert r1.loss == r2.loss and r1.grad_norm == r2.grad_norm
    assert max_param_diff(plain, ckpt) == 0.0


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_mixed_precision_step_tracks_fp32(name):
    x, y = batch(4)
    ref, opt_ref = make(sgd=True)
    low, opt_low = make(sgd=True)
    start = torch.cat([p.detach().flatten() for p in ref.parameters()])
    prec = Precision(name, CPU)
    assert (prec.scaler is not None) == (name == "fp16")
    r_ref = train_step(ref, [(x, y)], opt_ref, Precision("fp32", CPU), grad_clip=1.0)
    r_low = train_step(low, [(x, y)], opt_low, prec, grad_clip=1.0)
    assert abs(r_low.loss - r_ref.loss) < 0.02  # low-precision forward of the same weights
    assert all(p.dtype == torch.float32 for p in low.parameters())  # master weights stay fp32
    assert r_low.grad_norm == pytest.approx(r_ref.grad_norm, rel=0.05)
    upd_ref = torch.cat([p.detach().flatten() for p in ref.parameters()]) - start
    upd_low = torch.cat([p.detach().flatten() for p in low.parameters()]) - start
    assert torch.nn.functional.cosine_similarity(upd_ref, upd_low, dim=0) > 0.99


def test_non_finite_gradients_are_never_applied():
    x, y = batch(4)
    model, opt = make()
    before = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        model.tok_embeddings.weight[x[0, 0]] = float("nan")
    before["tok_embeddings.weight"] = model.tok_embeddings.weight.detach().clone()
    r = train_step(model, [(x, y)], opt, Precision("fp32", CPU), grad_clip=1.0)
    assert r.skipped
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]) or torch.isnan(v).any(), k
    assert not opt.state or all(s.get("step", 0) == 0 for s in opt.state.values())


def test_clip_by_value_then_norm_equals_torch():
    x, y = batch(4)
    ours, opt = make(sgd=True)
    ref, _ = make(sgd=True)
    train_step(ours, [(x, y)], opt, Precision("fp32", CPU), grad_clip=0.05, grad_clip_value=1e-3)
    loss = torch.nn.functional.cross_entropy(ref(x).view(-1, 97), y.view(-1))
    loss.backward()
    torch.nn.utils.clip_grad_value_(ref.parameters(), 1e-3)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    with torch.no_grad():
        for p in ref.parameters():
            p -= p.grad
    assert max_param_diff(ours, ref) < 1e-7


def test_group_grad_norms_and_update_ratios():
    x, y = batch(4)
    model, opt = make()
    before = {id(p): p.detach().clone() for p in model.parameters()}
    grads = {}

    def keep(p):
        grads[id(p)] = p.grad.detach().clone()

    hooks = [p.register_post_accumulate_grad_hook(keep) for p in model.parameters()]
    r = train_step(model, [(x, y)], opt, Precision("fp32", CPU), grad_clip=0.0, group_stats=True)
    for h in hooks:
        h.remove()
    assert set(r.group_grad_norms) == set(r.update_ratios) == {"decay", "no_decay"}
    total_sq = 0.0
    for g in opt.param_groups:
        norm = torch.sqrt(sum(grads[id(p)].double().square().sum() for p in g["params"]))
        total_sq += float(norm) ** 2
        assert r.group_grad_norms[g["name"]] == pytest.approx(float(norm), rel=1e-6)
        delta = torch.sqrt(sum((p.detach() - before[id(p)]).double().square().sum() for p in g["params"]))
        size = torch.sqrt(sum(before[id(p)].double().square().sum() for p in g["params"]))
        assert r.update_ratios[g["name"]] == pytest.approx(float(delta / size), rel=1e-5)
    assert r.grad_norm == pytest.approx(total_sq ** 0.5, rel=1e-6)


def test_rejected_step_leaves_weights_and_moments_alone():
    x, y = batch(4)
    model, opt = make()
    before = [p.detach().clone() for p in model.parameters()]
    r = train_step(model, [(x, y)], opt, Precision("fp32", CPU), grad_clip=1.0,
                   judge=lambda loss: Verdict(apply=False))
    assert r.skipped and not opt.state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
