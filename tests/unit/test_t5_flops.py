"""T5's parameter count and FLOPs (models/flops.py) against a real models/t5.py model: the count against
`model.parameters()`, the FLOP formula against the matmuls FlopCounterMode counts in one forward and one
forward + backward of a span-corruption-shaped batch (encoder 58, decoder 14 tokens: a 64-token window)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lmforge.config import ModelConfig
from lmforge.engine.objectives.span_corruption import SpanCorruption
from lmforge.models import build_model
from lmforge.models.flops import (
    adapter_flops_per_token,
    count_params,
    flops_per_token,
    t5_flops_per_token,
    t5_forward_flops,
    t5_run_flops_per_token,
)

VARIANTS = [dict(mlp="relu", tie_embeddings=True), dict(mlp="geglu", tie_embeddings=False)]
B, S, L, WINDOW = 2, 58, 14, 64


def cfg(**kw) -> ModelConfig:
    return ModelConfig(arch="t5", vocab_size=300, d_model=64, n_layers=2, n_decoder_layers=3, n_heads=4,
                       head_dim=12, d_ff=96, max_seq_len=64, dropout=0.0, **kw)


def masked_pairs(c: ModelConfig) -> int:
    """FLOPs of the decoder self-attention's masked-out half: the kernel computes every (query, key) pair,
    model FLOPs count the L (L + 1) / 2 a causal decoder needs (4 H D per pair, per block, per row)."""
    return 4 * c.n_heads * c.resolved_head_dim * (L * L - L * (L + 1) // 2) * c.n_decoder_layers * B


def _addmm_flops(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]  # (m, k) @ (k, n) added into (m, n)


def counted(model, train: bool) -> int:
    x = torch.randint(0, 300, (B, S), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 300, (B, L), generator=torch.Generator().manual_seed(1))
    # the math kernel: attention as two batched matmuls, which FlopCounterMode counts (the CPU's fused
    # kernel, taken where the mask needs no gradient, is not in its registry); the fused LoRA function
    # adds its low-rank products in place (addmm_), which the registry leaves out too
    mapping = {torch.ops.aten.addmm_: _addmm_flops}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        out = model(x, y)
        if train:
            out.logsumexp(-1).sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("kw", VARIANTS)
def test_t5_param_count_equals_model(kw):
    c = cfg(**kw)
    total = sum(p.numel() for p in build_model(c).parameters())
    assert count_params(c) == total
    # non-embedding: the head stays counted when tied, the token table goes when the head is its own
    head = 0 if c.tie_embeddings else c.vocab_size * c.d_model
    assert count_params(c, exclude_embeddings=True) == total - head


@pytest.mark.parametrize("kw", VARIANTS)
def test_t5_flops_equal_counted_matmuls(kw):
    c = cfg(**kw)
    torch.manual_seed(0)
    model = build_model(c)
    forward = B * t5_forward_flops(c, S, L)
    got = counted(model, train=False)
    # exact once the causal mask's skipped half is added; what is left out otherwise (lookups, norms,
    # activations, softmax, the tied head's rescale) are no matmuls
    assert got == forward + masked_pairs(c)
    assert abs(got / forward - 1) < 0.03  # and the skipped half is a few percent at these lengths
    # training: every matmul's input and weight gradients, every attention product's two gradients
    training = B * WINDOW * t5_flops_per_token(c, S, L, WINDOW)
    assert counted(model, train=True) == training + 3 * masked_pairs(c)


def test_t5_adapter_flops_near_counted_lora_step():
    from lmforge.finetune.lora import apply_lora

    c = cfg(mlp="geglu", tie_embeddings=False)
    torch.manual_seed(0)
    model = build_model(c)
    apply_lora(model, "all-linear", r=4, alpha=8.0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    want = B * WINDOW * t5_flops_per_token(c, S, L, WINDOW, adapter_params=trainable) + 3 * masked_pairs(c)
    full = B * WINDOW * t5_flops_per_token(c, S, L, WINDOW)
    got = counted(model, train=True)
    # Left out by the formula: the input gradients autograd skips in each stack's first block (nothing
    # before its q, k, v projections trains: 2 FLOPs per weight per token), and which stack's tokens
    # each adapter sees (counted at the mean length: the 1-2% left).
    skipped = 2 * 3 * c.d_model * c.n_heads * c.resolved_head_dim * (S + L) * B
    assert abs(got / (want - skipped) - 1) < 0.03 and got < 0.8 * full


def test_span_corruption_run_counts_per_window_token():
    c = cfg(mlp="relu", tie_embeddings=True)
    objective = SpanCorruption()
    assert objective.lengths(WINDOW) == (S, L)
    per_window = t5_flops_per_token(c, S, L, WINDOW)
    assert t5_run_flops_per_token(c, WINDOW, objective) == per_window
    assert flops_per_token(c, WINDOW, objective) == per_window  # what the trainer's MFU uses
    assert adapter_flops_per_token(c, WINDOW, 1000, objective) == t5_flops_per_token(c, S, L, WINDOW, 1000)
    # rows of their own tokens (no lengths from the objective): both rows seq_len long, per token read
    assert flops_per_token(c, WINDOW) == 3 * t5_forward_flops(c, WINDOW, WINDOW) / (2 * WINDOW)
