"""Pruning maths: magnitude masks (per layer and global, checked against torch.nn.utils.prune), Wanda's
activation norms, the 2:4 pattern (against torchao's mask), structured removal of kv groups / MLP
channels equal to zeroing them in the full model, the option checks, and zeros kept exactly through
AdamW steps with weight decay and carried-over momentum."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

from lmforge.compress.prune import PruneSpec, prune_model, units_to_remove
from lmforge.compress.sparsity import (
    KeepSparsity,
    apply_masks,
    input_norms,
    prunable_weights,
    scores_of,
    semi_structured_masks,
    semi_structured_ok,
    sparsity_stats,
    unstructured_masks,
)
from lmforge.compress.structured import channel_scores, head_scores, keep_highest, shrink, zero_units
from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models import build_model

GQA = dict(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)  # groups of 2
# GPT-2 style: no GQA, biases everywhere, GELU MLP, learned positions, untied head.
MHA_BIAS = dict(vocab_size=96, d_model=48, n_layers=2, n_heads=3, max_seq_len=32, bias=True, norm="layernorm",
                mlp="gelu", pos_embedding="learned", tie_embeddings=False)


def _model(seed: int = 0, **kw):
    torch.manual_seed(seed)
    return build_model(ModelConfig(**(kw or GQA)))


def _ids(seed: int = 1, b: int = 3, t: int = 16) -> torch.Tensor:
    return torch.randint(0, 96, (b, t), generator=torch.Generator().manual_seed(seed))


def test_prunable_weights_are_the_block_linears_unless_the_head_is_asked_for():
    model = _model()
    names = set(prunable_weights(model))
    assert len(names) == 2 * 7 and all(n.startswith("layers.") for n in names)
    assert "tok_embeddings.weight" in prunable_weights(model, include_head=True)
    assert "output.weight" in prunable_weights(_model(**MHA_BIAS), include_head=True)


def test_layer_magnitude_masks_are_exact_and_equal_torch_prune():
    model = _model()
    weights = prunable_weights(model)
    masks = unstructured_masks(scores_of(weights, None), 0.3, "layer")
    for name, w in weights.items():
        assert int((~masks[name]).sum()) == round(0.3 * w.numel())
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w.detach())
        torch_prune.l1_unstructured(lin, "weight", amount=0.3)
        assert torch.equal(lin.weight_mask.bool(), masks[name]), name
    apply_masks(weights, masks)
    stats = sparsity_stats(model)
    assert all(abs(s - 0.3) < 1e-3 for s in stats["per_layer"].values())


def test_global_magnitude_ranks_all_weights_together_like_torch_global_unstructured():
    model = _model()
    weights = prunable_weights(model)
    masks = unstructured_masks(scores_of(weights, None), 0.5, "global")
    total = sum(w.numel() for w in weights.values())
    assert int(sum((~m).sum() for m in masks.values())) == round(0.5 * total)
    ref = copy.deepcopy(model)
    params = [(ref.get_submodule(n.removesuffix(".weight")), "weight") for n in weights]
    torch_prune.global_unstructured(params, pruning_method=torch_prune.L1Unstructured, amount=0.5)
    for (module, _), name in zip(params, weights):
        assert torch.equal(module.weight_mask.bool(), masks[name]), name
    # Global ranking does not give every matrix the same sparsity (the residual outputs are smaller at init).
    per = [1 - m.float().mean().item() for m in masks.values()]
    assert max(per) - min(per) > 0.1


def test_wanda_norms_are_input_feature_norms_over_all_calibration_tokens():
    model = _model()
    batches = [_ids(1), _ids(2)]
    norms = input_norms(model, batches, ["layers.0.attn.wq.weight", "tok_embeddings.weight"])
    with torch.no_grad():
        x = torch.cat([model.layers[0].attn_norm(model.tok_embeddings(b)) for b in batches])  # (B, T, d)
        h = torch.cat([model(b, head=lambda x, w: x) for b in batches])  # the final norm's output
    close = dict(rtol=1e-5, atol=0)
    torch.testing.assert_close(norms["layers.0.attn.wq.weight"], x.pow(2).sum((0, 1)).sqrt(), **close)
    torch.testing.assert_close(norms["tok_embeddings.weight"], h.pow(2).sum((0, 1)).sqrt(), **close)
    w = prunable_weights(model)["layers.0.attn.wq.weight"]
    scores = scores_of({"w": w}, {"w": norms["layers.0.attn.wq.weight"]})["w"]
    torch.testing.assert_close(scores, w.detach().abs() * norms["layers.0.attn.wq.weight"][None, :])
    magnitude = unstructured_masks({"w": w.detach().abs()}, 0.5)["w"]
    wanda = unstructured_masks({"w": scores}, 0.5)["w"]
    assert not torch.equal(magnitude, wanda)  # the activations change which weights go


def test_two_four_keeps_two_of_every_four_along_the_input_dim_as_torchao():
    from torchao.sparsity.utils import mask_creator

    model = _model()
    weights = prunable_weights(model)
    masks = semi_structured_masks(scores_of(weights, None))
    for name, w in weights.items():
        groups = masks[name].view(w.shape[0], -1, 4)
        assert bool((groups.sum(-1) == 2).all()), name
        assert torch.equal(mask_creator(w.detach()).bool(), masks[name]), name
    apply_masks(weights, masks)
    for name, w in weights.items():
        assert semi_structured_ok(w)
        assert bool((w.view(w.shape[0], -1, 4) == 0).sum(-1).eq(2).all()), name
        # the pattern is along rows (input dim): the transposed weight does not have it
        assert not semi_structured_ok(w.t().contiguous())
    with pytest.raises(LmforgeError, match="multiple of 4"):
        semi_structured_masks({"w": torch.rand(8, 6)})


@pytest.mark.parametrize("kw", [GQA, MHA_BIAS], ids=["gqa", "mha-bias"])
@pytest.mark.parametrize("score", ["magnitude", "wanda"])
def test_removing_heads_equals_zeroing_them_in_the_full_model(kw, score):
    model = _model(**kw)
    if score == "wanda":
        norms = input_norms(model, [_ids()], [f"layers.{i}.attn.wo.weight" for i in range(2)])
    scores = head_scores(model, norms if score == "wanda" else None)
    hkv = model.cfg.resolved_kv_heads
    assert scores.shape == (2, hkv)
    keep = keep_highest(scores, 1)
    small = shrink(model, kv_groups=keep)
    g = model.cfg.n_heads // hkv
    assert (small.cfg.n_heads, small.cfg.resolved_kv_heads) == (model.cfg.n_heads - g, hkv - 1)
    assert small.cfg.head_dim == model.cfg.resolved_head_dim  # explicit: d_model / n_heads no longer gives it
    zero_units(model, kv_groups=keep)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(small(ids), model(ids), rtol=0, atol=1e-6)
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kw", [GQA, MHA_BIAS], ids=["swiglu", "gelu-bias"])
def test_removing_channels_equals_zeroing_them_in_the_full_model(kw):
    model = _model(**kw)
    ff = model.cfg.resolved_d_ff
    keep = keep_highest(channel_scores(model), ff // 3)
    small = shrink(model, channels=keep)
    assert small.cfg.d_ff == ff - ff // 3
    zero_units(model, channels=keep)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(small(ids), model(ids), rtol=0, atol=1e-6)


def test_structured_scores_remove_the_least_important_units():
    model = _model()
    with torch.no_grad():  # make kv group 1 of layer 0 and channel 5 of layer 1 negligible
        model.layers[0].attn.wo.weight[:, 32:] *= 1e-3
        model.layers[0].attn.wq.weight[32:] *= 1e-3
        mlp = model.layers[1].mlp
        mlp.w_down.weight[:, 5] *= 1e-3
        mlp.w_up.weight[5] *= 1e-3
        mlp.w_gate.weight[5] *= 1e-3
        mlp.w_down.weight[:, 7] = 0  # writes nothing: only the activation-aware score sees it
    assert keep_highest(head_scores(model), 1)[0].tolist() == [0]
    kept = keep_highest(channel_scores(model), 1)[1]
    assert 5 not in kept.tolist() and len(kept) == model.cfg.resolved_d_ff - 1
    assert torch.equal(kept, kept.sort().values)  # the original order is kept
    norms = input_norms(model, [_ids()], [f"layers.{i}.mlp.w_down.weight" for i in range(2)])
    assert 7 not in keep_highest(channel_scores(model, norms), 1)[1].tolist()


def test_kept_model_config_is_ordinary_and_generates_with_a_kv_cache():
    from lmforge.models.common.attention import KVCache

    model = _model()
    small, details = prune_model(model, PruneSpec("heads", heads=2))
    assert details["kv_groups_removed"] == 1 and details["heads_removed"] == 2
    cfg = ModelConfig.model_validate(small.cfg.model_dump())  # round-trips through validation
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (2, 1, 16)
    ids = _ids(b=1, t=8)
    cache = KVCache(small, 1, 16)
    with torch.no_grad():
        full = small(ids)
        step = torch.cat([small(ids[:, :5], cache=cache), small(ids[:, 5:], cache=cache)], dim=1)
    torch.testing.assert_close(step, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "spec, match",
    [
        (PruneSpec("magnitude", sparsity=1.0), r"\(0, 1\)"),
        (PruneSpec("magnitude", sparsity=-0.1), r"\(0, 1\)"),
        (PruneSpec("magnitude", sparsity=0.0), r"\(0, 1\)"),  # a "success" that prunes nothing
        (PruneSpec("magnitude"), "needs --sparsity"),
        (PruneSpec("heads", heads=1), "multiple of 2"),
        (PruneSpec("heads", heads=4), "between 1 and 3"),
        (PruneSpec("heads", heads=6), "between 1 and 3"),
        (PruneSpec("heads"), "either --heads"),
        (PruneSpec("heads", heads=2, ratio=0.5), "either --heads"),
        (PruneSpec("heads", ratio=0.1), "rounds to 0 groups"),
        (PruneSpec("channels", channels=192), "between 1 and 191"),
        (PruneSpec("channels", ratio=1.0), r"\(0, 1\)"),
        (PruneSpec("2:4", sparsity=0.5), "--sparsity does not go with --method 2:4"),
        (PruneSpec("heads", heads=2, include_head=True), "--include-head"),
        (PruneSpec("random"), "valid methods"),
        (PruneSpec("magnitude", sparsity=0.5, scope="row"), "valid scopes"),
        (PruneSpec("2:4", calib="x.txt"), "--calib gives the activations of --score wanda"),
    ],
)
def test_bad_specs_are_refused_with_the_option_named(spec, match):
    with pytest.raises(LmforgeError, match=match):
        units_to_remove(spec, ModelConfig(**GQA))


@pytest.mark.parametrize("spec", [PruneSpec("magnitude", sparsity=0.5), PruneSpec("2:4"),
                                  PruneSpec("heads", heads=2), PruneSpec("channels", ratio=0.5)])
def test_a_quantized_model_is_refused_not_pruned_to_zero_sparsity(spec):
    """An int8 run's block weights are integers and scales: every method used to "succeed" with 0.00%
    sparsity (unstructured) or fail inside (structured)."""
    from lmforge.config.schema import QuantConfig
    from lmforge.models.quant import QuantLinear

    with pytest.raises(LmforgeError, match=r"quantized \(model.quant: int8.*prune the run it was quantized"):
        units_to_remove(spec, ModelConfig(**GQA, quant=QuantConfig(bits=8, group_size=None)))
    model = _model()
    model.layers[0].attn.wq = QuantLinear.from_linear(model.layers[0].attn.wq, 8, None, True)
    with pytest.raises(LmforgeError, match="layers are quantized \\(QuantLinear\\)"):
        prune_model(model, spec)


def test_mixture_of_experts_prunes_what_it_reaches_and_says_what_it_did_not():
    cfg = dict(GQA, moe={"n_experts": 4, "top_k": 2, "d_ff_expert": 32})
    model, details = prune_model(_model(**cfg), PruneSpec("magnitude", sparsity=0.5))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".moe." in n)
    assert details["not_pruned"] == {"moe_expert_params": experts} and experts > 0
    assert sparsity_stats(model)["overall"] == pytest.approx(0.5, abs=1e-6)
    assert "not_pruned" not in prune_model(_model(), PruneSpec("magnitude", sparsity=0.5))[1]
    with pytest.raises(LmforgeError, match="mixture-of-experts layers"):
        prune_model(_model(**cfg), PruneSpec("channels", ratio=0.5))


def test_the_output_head_is_pruned_only_when_asked():
    model, _ = prune_model(_model(), PruneSpec("magnitude", sparsity=0.5))
    assert bool((model.tok_embeddings.weight != 0).all())
    stats = sparsity_stats(model)
    assert stats["overall"] == pytest.approx(0.5, abs=1e-6) and stats["of_all_params"] < 0.5
    model, _ = prune_model(_model(), PruneSpec("2:4", include_head=True))
    emb = model.tok_embeddings.weight  # tied: the head's weight, (vocab, d_model), 2:4 along d_model
    assert semi_structured_ok(emb) and float((emb == 0).float().mean()) == 0.5


def test_ratio_counts():
    cfg = ModelConfig(**GQA)
    assert units_to_remove(PruneSpec("heads", ratio=0.5), cfg) == 1  # one of two kv groups
    assert units_to_remove(PruneSpec("channels", ratio=0.25), cfg) == 48
    assert units_to_remove(PruneSpec("heads", heads=2), cfg) == 1


def _train_steps(model, opt, keeper, n: int, seed: int) -> None:
    for k in range(n):
        ids = _ids(seed + k)
        loss = nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if keeper is not None:
            keeper.reapply()


@pytest.mark.parametrize("fused", [False, True])
def test_zeros_stay_exactly_zero_through_adamw_with_weight_decay_and_momentum(fused):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    _train_steps(model, opt, None, 3, seed=10)  # dense steps: Adam's moments are non-zero everywhere
    weights = prunable_weights(model)
    apply_masks(weights, unstructured_masks(scores_of(weights, None), 0.5))
    pruned = {n: (w == 0).clone() for n, w in weights.items()}
    before = {n: w.detach().clone() for n, w in weights.items()}

    keeper = KeepSparsity()
    keeper.attach(model)
    assert set(keeper.masks) == set(weights)
    _train_steps(model, opt, keeper, 4, seed=20)
    for n, w in weights.items():
        assert bool((w[pruned[n]] == 0).all()), n  # exactly zero, not small
        assert bool((w[~pruned[n]] != before[n][~pruned[n]]).any()), n  # the kept weights trained
    # A resumed run reads the same masks back from the weights.
    again = KeepSparsity()
    again.attach(model)
    assert all(torch.equal(again.masks[n][1], ~pruned[n]) for n in weights)
    keeper.detach(), again.detach()

    # The carried-over momentum alone moves pruned weights: the re-zeroing is what keeps them at 0.
    _train_steps(model, opt, None, 1, seed=30)
    assert any(bool((w[pruned[n]] != 0).any()) for n, w in weights.items())


def test_masked_gradients_keep_zeros_with_a_fresh_optimizer_and_exclude_them_from_the_norm():
    model = _model()
    weights = prunable_weights(model)
    apply_masks(weights, semi_structured_masks(scores_of(weights, None)))
    pruned = {n: (w == 0).clone() for n, w in weights.items()}
    keeper = KeepSparsity()
    keeper.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train_steps(model, opt, None, 3, seed=40)  # no re-zeroing: the gradient mask alone
    for n, w in weights.items():
        assert bool((w[pruned[n]] == 0).all()), n
        assert bool((w.grad[pruned[n]] == 0).all()), n
        assert semi_structured_ok(w)
    keeper.detach()
    _train_steps(model, opt, None, 1, seed=50)  # hooks removed: gradients flow again
    assert any(bool((w.grad[pruned[n]] != 0).any()) for n, w in weights.items())
