"""The chunked linear + cross-entropy equals F.linear + F.cross_entropy(reduction="sum"): loss and
gradients, with ignored targets, one-sided gradients, bf16 autocast and torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.engine.chunked_loss import chunked_linear_cross_entropy

IGNORE = -100


def make(n: int, d: int, v: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Hidden states ~ N(0, 1) (as after a final RMSNorm), a projection of std 0.1 (logits of std
    ~0.1 sqrt(d), as in a model early in training) and targets with every 5th one ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype)
    weight = 0.1 * torch.randn(v, d, generator=g, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = IGNORE
    return hidden, weight, targets


def reference(hidden, weight, targets, ignore_index: int = IGNORE) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(
        logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=ignore_index, reduction="sum"
    )


def loss_and_grads(fn, hidden, weight, targets, **kw):
    """fn's loss and its gradients with respect to hidden and weight (both leaves needing grad)."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = fn(h, w, targets, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # rtol 1e-6 (~8 fp32 ulps). atol = 1e-6 x the largest |entry|: an entry that cancels to near zero
    # is a sum of terms as large as the largest entries, and chunking changes the GEMM blocking (so the
    # logits' and the sums' rounding), which moves such entries by a few ulps of those terms: measured
    # <= 2e-7 x max over 120 seeds and shapes at these scales. The bugs it must catch (an ignored row
    # counted, a chunk lost, the upstream grad dropped) are off by >= 1e-3 of the largest entry.
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


# (N, d, V, chunk_tokens): N not divisible by the chunk, divisible, chunk == N, chunk > N, chunk = 1
SHAPES = [(37, 16, 50, 5), (64, 32, 96, 16), (37, 16, 50, 37), (20, 16, 50, 64), (23, 8, 40, 1)]


@pytest.mark.parametrize("n,d,v,chunk", SHAPES)
def test_fp32_loss_and_grads_equal_the_reference(n, d, v, chunk):
    hidden, weight, targets = make(n, d, v)
    if n >= 2 * chunk:
        targets[chunk : 2 * chunk] = IGNORE  # one chunk with no target at all: contributes nothing
    ref = loss_and_grads(reference, hidden, weight, targets)
    ours = loss_and_grads(chunked_linear_cross_entropy, hidden, weight, targets, chunk_tokens=chunk)
    assert ours[0].dtype == torch.float32 and ours[0].dim() == 0
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=0.0)
    assert_fp32_close(ours[1], ref[1])
    assert_fp32_close(ours[2], ref[2])


def test_batched_input_b_t_d():
    hidden, weight, targets = make(2 * 13, 16, 50)
    hidden, targets = hidden.view(2, 13, 16), targets.view(2, 13)
    ref = loss_and_grads(reference, hidden, weight, targets)
    ours = loss_and_grads(chunked_linear_cross_entropy, hidden, weight, targets, chunk_tokens=6)
    assert ours[1].shape == (2, 13, 16)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=0.0)
    assert_fp32_close(ours[1], ref[1])
    assert_fp32_close(ours[2], ref[2])


@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_only_one_input_requires_grad(which):
    hidden, weight, targets = make(30, 16, 50)
    _, ref_h, ref_w = loss_and_grads(reference, hidden, weight, targets)
    h = hidden.clone().requires_grad_(which == "hidden")
    w = weight.clone().requires_grad_(which == "weight")
    chunked_linear_cross_entropy(h, w, targets, chunk_tokens=8).backward()
    if which == "hidden":
        assert w.grad is None
        assert_fp32_close(h.grad, ref_h)
    else:
        assert h.grad is None
        assert_fp32_close(w.grad, ref_w)


def test_upstream_grad_scales_and_a_second_backward_sees_the_same_grads():
    """A mean over tokens (what training does with the sum) scales the saved gradients; they are not
    modified in place, so retain_graph gives the same gradients twice."""
    hidden, weight, targets = make(30, 16, 50)
    n_tok = int((targets != IGNORE).sum())
    _, ref_h, ref_w = loss_and_grads(lambda *a: reference(*a) / n_tok, hidden, weight, targets)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = chunked_linear_cross_entropy(h, w, targets, chunk_tokens=8) / n_tok
    g1 = torch.autograd.grad(loss, (h, w), retain_graph=True)
    g2 = torch.autograd.grad(loss, (h, w))
    for a, b, e in zip(g1, g2, (ref_h, ref_w)):
        assert_fp32_close(a, e)
        assert torch.equal(a, b)


def test_all_targets_ignored_gives_zero_loss_and_zero_grads():
    hidden, weight, targets = make(12, 8, 20)
    targets[:] = IGNORE
    loss, gh, gw = loss_and_grads(chunked_linear_cross_entropy, hidden, weight, targets, chunk_tokens=5)
    assert loss.item() == 0.0 == reference(hidden, weight, targets).item()
    assert not gh.any() and not gw.any()


def test_ignored_targets_are_what_is_left_out():
    """Un-ignoring one target adds exactly that token's loss; a custom ignore_index is honoured."""
    hidden, weight, targets = make(20, 8, 30)
    with torch.no_grad():
        base = chunked_linear_cross_entropy(hidden, weight, targets, chunk_tokens=6)
        more = targets.clone()
        more[5] = 3  # was ignored
        token = F.cross_entropy(F.linear(hidden[5], weight), torch.tensor(3), reduction="sum")
        added = chunked_linear_cross_entropy(hidden, weight, more, chunk_tokens=6) - base
        # rtol 1e-5: `added` is the difference of two fp32 sums of ~50, each rounded by ~50 x 6e-8
        torch.testing.assert_close(added, token, rtol=1e-5, atol=0.0)
        assert token > 0.1  # the difference is far above rounding: a wrong ignore cannot hide in it
        # ignore_index=7: tokens whose target is 7 drop out (-100 would be out of range, so it becomes 7)
        plain = targets.clone()
        plain[plain == IGNORE] = 7
        assert (plain == 7).sum() > 3
        torch.testing.assert_close(
            chunked_linear_cross_entropy(hidden, weight, plain, chunk_tokens=6, ignore_index=7),
            reference(hidden, weight, plain, ignore_index=7),
            rtol=1e-6,
            atol=0.0,
        )


def test_no_grad_gives_the_same_loss():
    hidden, weight, targets = make(30, 16, 50)
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(hidden, weight.requires_grad_(), targets, chunk_tokens=8)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference(hidden, weight, targets).detach(), rtol=1e-6, atol=0.0)


def test_bad_arguments_are_refused():
    hidden, weight, targets = make(10, 8, 20)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_linear_cross_entropy(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="targets"):
        chunked_linear_cross_entropy(hidden, weight, targets[:-1], chunk_tokens=4)
    with pytest.raises(ValueError, match="weight"):
        chunked_linear_cross_entropy(hidden, weight[:, :-1], targets, chunk_tokens=4)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative error in the Frobenius norm: stable from seed to seed, unlike the largest entry's."""
    return float((actual.float() - expected).norm() / expected.norm())


def test_bf16_autocast_is_as_accurate_as_plain_autocast():
    # 64 chunks: a weight gradient summed in bf16 would be ~3.4x plain autocast's error here
    hidden, weight, targets = make(256, 64, 320, seed=1)
    ref = loss_and_grads(reference, hidden, weight, targets)  # fp32, no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = loss_and_grads(reference, hidden, weight, targets)
        ours = loss_and_grads(chunked_linear_cross_entropy, hidden, weight, targets, chunk_tokens=4)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == ours[2].dtype == torch.float32
    # the matmuls really ran in bf16: off from fp32 by bf16-sized amounts (the fp32 path: < 1e-6)
    assert _rel_err(ours[1], ref[1]) > 2**-12
    # bf16 unit roundoff u = 2^-9. Loss: each token's logits carry ~u relative error that mostly
    # averages out over tokens, so the sum is within u relative (measured ~5e-5).
    assert abs(float(ours[0] - ref[0])) <= 2**-9 * float(ref[0])
    # Gradients: inputs, grad_logits and the products are each rounded to bf16, a few u compounding:
    # within 4u = 2^-7 (measured ~1.4u, the same as plain autocast), and no worse than 2x plain
    # autocast's error (measured 0.95-1.0x: the weight gradient's bf16 chunk products are summed in fp32)
    for a, p, e in zip(ours[1:], plain[1:], ref[1:]):
        err_ours, err_plain = _rel_err(a, e), _rel_err(p, e)
        assert err_ours <= 2**-7, (err_ours, err_plain)
        assert err_ours <= 2 * err_plain, (err_ours, err_plain)


def test_bf16_inputs_get_bf16_grads():
    hidden, weight, targets = make(30, 16, 50, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = loss_and_grads(reference, hidden, weight, targets)
        ours = loss_and_grads(chunked_linear_cross_entropy, hidden, weight, targets, chunk_tokens=8)
    assert ours[1].dtype == ours[2].dtype == torch.bfloat16
    # same bf16 matmuls and fp32 softmax as plain: the loss agrees to fp32 rounding of the sum
    torch.testing.assert_close(ours[0], plain[0], rtol=1e-6, atol=0.0)
    for a, p in zip(ours[1:], plain[1:]):
        assert _rel_err(a, p.float()) <= 2**-8  # bf16 results may round the other way: ~1 ulp


@pytest.mark.slow  # cold inductor compile: 17 s on 2 idle cores, 36 s with the machine busy (5 s cached)
def test_torch_compile_matches_eager():
    hidden, weight, targets = make(10, 8, 24)
    targets[3] = IGNORE

    def fn(h, w, t):
        return chunked_linear_cross_entropy(h, w, t, chunk_tokens=4)

    eager = loss_and_grads(fn, hidden, weight, targets)
    compiled = loss_and_grads(torch.compile(fn, fullgraph=True), hidden, weight, targets)  # no graph breaks
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=0.0)
    assert_fp32_close(compiled[1], eager[1])
    assert_fp32_close(compiled[2], eager[2])
