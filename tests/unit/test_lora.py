"""LoRA / DoRA adapters: identity at init, freezing, merge / unmerge, target patterns, scaling, dropout,
torch.compile, quantized bases, and the checks of the PEFT adapter files (parity with PEFT itself is
tests/parity/test_lora_peft.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config import ModelConfig
from lmforge.errors import ConfigError, LmforgeError
from lmforge.finetune.lora import (
    LoRALinear,
    adapter_state_dict,
    apply_lora,
    lora_layers,
    merge_lora,
    merged_for_inference,
    unmerge_lora,
)
from lmforge.finetune.peft_io import load_peft_adapter, save_peft_adapter
from lmforge.models import Transformer

V, ATOL = 97, 1e-5
KINDS = ["attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down"]
ALL_BLOCK_LINEARS = [f"layers.{i}.{k}" for i in range(2) for k in KINDS]


def cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                tie_embeddings=False)
    return ModelConfig(**{**base, **kw})


def model(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg(**kw)).eval()


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(seed))


def perturb_magnitudes(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for layer in lora_layers(m).values():
            if layer.dora:
                layer.lora_magnitude.mul_(1.0 + 0.2 * torch.randn(layer.lora_magnitude.shape, generator=g))


@pytest.mark.parametrize("dora", [False, True])
def test_default_init_leaves_logits_unchanged(dora):
    m = model(bias=True)
    x = ids()
    with torch.no_grad():
        ref = m(x)
        apply_lora(m, "all-linear", r=4, alpha=8, dora=dora)
        got = m(x)
    assert torch.equal(got, ref)  # B = 0 (and m = ||W||): the adapter adds exactly zero
    assert all(layer.lora_A.abs().amax() > 0 for layer in lora_layers(m).values())


@pytest.mark.parametrize("dora", [False, True])
def test_only_adapters_train(dora):
    m = model()
    frozen = {n: p.detach().clone() for n, p in m.named_parameters()}
    names = apply_lora(m, ["wq", "w_down"], r=2, alpha=4, dora=dora, init="seeded")
    assert names == ["layers.0.attn.wq", "layers.0.mlp.w_down", "layers.1.attn.wq", "layers.1.mlp.w_down"]
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    per_layer = ["lora_A", "lora_B"] + (["lora_magnitude"] if dora else [])
    assert trainable == [f"{n}.{p}" for n in names for p in per_layer]
    assert list(adapter_state_dict(m)) == trainable
    assert "layers.0.attn.wq.base.weight" in m.state_dict()

    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
    m.train()
    F.cross_entropy(m(ids()).reshape(-1, V), ids(2).reshape(-1)).backward()
    opt.step()
    after = dict(m.named_parameters())
    for n, p in frozen.items():  # base weights (renamed under .base) are bit-for-bit untouched
        name = n.replace(".wq.", ".wq.base.").replace(".w_down.", ".w_down.base.")
        assert torch.equal(after[name], p) and after[name].grad is None, name
    for n, p in before.items():
        assert after[n].grad.abs().amax() > 0 and (after[n] - p).abs().amax() > 1e-3, n


@pytest.mark.parametrize("dora", [False, True])
def test_merge_equals_unmerged_and_unmerge_is_exact(dora):
    m = model(bias=True)
    original = {n: p.detach().clone() for n, p in m.state_dict().items()}
    apply_lora(m, "all-linear", r=4, alpha=8, dora=dora, init="seeded")
    perturb_magnitudes(m)
    x = ids()
    with torch.no_grad():
        ref = m(x)
        merge_lora(m, reversible=True)
        assert all(layer.merged for layer in lora_layers(m).values())
        torch.testing.assert_close(m(x), ref, atol=ATOL, rtol=0)
        unmerge_lora(m)
        for n, w in original.items():
            ours = m.state_dict()[n.replace(".weight", ".base.weight").replace(".bias", ".base.bias")
                                  if any(k in n for k in KINDS) else n]
            assert torch.equal(ours, w), n
        torch.testing.assert_close(m(x), ref, atol=0, rtol=0)

        merge_lora(m)
        assert not lora_layers(m) and list(m.state_dict()) == list(original)
        assert not any(p.requires_grad for p in m.parameters())
        torch.testing.assert_close(m(x), ref, atol=ATOL, rtol=0)


def test_target_patterns():
    def wrapped(targets, **kw):
        return apply_lora(model(**kw), targets, r=2, alpha=2)

    assert wrapped("layers.*.attn.wq") == ["layers.0.attn.wq", "layers.1.attn.wq"]
    wq = ["layers.0.attn.wq", "layers.1.attn.wq"]
    assert wrapped("wq") == wrapped("q_proj") == wrapped(["attn.wq"]) == wq
    mixed = ["layers.0.attn.wk", "layers.1.attn.wk", "layers.1.mlp.w_up"]
    assert wrapped(["k_proj", "layers.1.mlp.w_up"]) == mixed
    assert wrapped("all-linear") == ALL_BLOCK_LINEARS  # the output head is left out
    assert wrapped(["gate_proj", "up_proj", "down_proj", "v_proj", "o_proj"]) == [
        n for n in ALL_BLOCK_LINEARS if not n.endswith(("wq", "wk"))
    ]
    assert wrapped("lm_head") == wrapped("output") == ["output"]
    with pytest.raises(ConfigError, match=r"'w_qkv'.*layers\.\{i\}\.attn\.wq, .*output"):
        wrapped(["wq", "w_qkv"])
    with pytest.raises(ConfigError, match="'lm_head'.* matches no linear layer"):
        wrapped("lm_head", tie_embeddings=True)  # tied: no separate output layer
    with pytest.raises(ConfigError, match="no LoRA target"):
        wrapped([])
    m = model()
    apply_lora(m, "wq", r=2, alpha=2)
    with pytest.raises(ConfigError, match="already carries LoRA adapters"):
        apply_lora(m, "wv", r=2, alpha=2)
    for bad in (dict(r=0), dict(alpha=float("nan")), dict(dropout=1.0), dict(init="pissa")):
        with pytest.raises(ConfigError):
            apply_lora(model(), "wq", **{"r": 2, "alpha": 2, **bad})


@pytest.mark.parametrize("rslora", [False, True])
def test_scaling_and_delta(rslora):
    torch.manual_seed(0)
    base = nn.Linear(16, 8)
    g = torch.Generator().manual_seed(1)
    layer = LoRALinear(base, r=4, alpha=6, rslora=rslora, init="seeded", generator=g)
    assert layer.scaling == (6 / math.sqrt(4) if rslora else 6 / 4)
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = base(x) + x @ layer.lora_A.T @ layer.lora_B.T * layer.scaling
        torch.testing.assert_close(layer(x), expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(layer.weight, base.weight + layer.scaling * layer.lora_B @ layer.lora_A,
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("dora", [False, True])
def test_dropout_acts_in_training_only(dora):
    m = model()
    apply_lora(m, "all-linear", r=4, alpha=8, dropout=0.5, dora=dora, init="seeded")
    perturb_magnitudes(m)
    ref = model()
    apply_lora(ref, "all-linear", r=4, alpha=8, dropout=0.0, dora=dora, init="seeded")
    perturb_magnitudes(ref)
    x = ids()
    with torch.no_grad():
        assert torch.equal(m.eval()(x), ref.eval()(x))  # eval: no dropout anywhere
        m.train()
        a, b = m(x), m(x)
    assert (a - b).abs().amax() > 1e-2


@pytest.mark.parametrize("dora", [False, True])
def test_torch_compile_matches_eager(dora):
    m = model(bias=True, n_layers=1)  # every kind of adapted linear, traced once (compiling is the cost)
    apply_lora(m, "all-linear", r=4, alpha=8, dora=dora, init="seeded")
    perturb_magnitudes(m)
    x = ids()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)  # fullgraph: no graph breaks
    torch.testing.assert_close(compiled(x), m(x), atol=ATOL, rtol=0)
    # Training: the fused and grouped functions' backward through the compiled graph.
    m.train()
    grads = []
    for f in (compiled, m):
        m.zero_grad(set_to_none=True)
        f(x).square().mean().backward()
        grads.append([p.grad for p in m.parameters() if p.requires_grad])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def _lora_linear(seed: int = 0, bias: bool = True) -> LoRALinear:
    torch.manual_seed(seed)
    base = nn.Linear(24, 40, bias=bias).requires_grad_(False)
    layer = LoRALinear(base, r=4, alpha=8, init="seeded", generator=torch.Generator().manual_seed(seed))
    return layer.train()


def _run(layer: LoRALinear, x: torch.Tensor, fused: bool, autocast: bool = False):
    x = x.clone().requires_grad_()
    layer.lora_A.grad = layer.lora_B.grad = None
    original = LoRALinear._fusable
    LoRALinear._fusable = (lambda self: original(self)) if fused else (lambda self: False)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        assert layer._fusable() is fused
    finally:
        LoRALinear._fusable = original
    g = torch.linspace(-1, 1, y.numel()).view_as(y)
    (y.float() * g).sum().backward()
    return y, x.grad, layer.lora_A.grad, layer.lora_B.grad


@pytest.mark.parametrize("bias", [False, True])
def test_fused_function_equals_the_module_graph(bias):
    """The fused LoRA function (one addmm into the base GEMM, hand-written backward) gives the
    output, input gradient and A/B gradients of base(x) + s B A x computed op by op (fp32)."""
    layer = _lora_linear(bias=bias)
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(1))
    fused, plain = _run(layer, x, True), _run(layer, x, False)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_fused_function_under_autocast():
    """Under bf16 autocast the adapter computes in bf16 (as autocast computes any linear layer),
    keeps float32 gradients on its float32 A and B, and stays within bf16 rounding of fp32."""
    layer = _lora_linear()
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(1))
    y16, gx16, ga16, gb16 = _run(layer, x, True, autocast=True)
    y, gx, ga, gb = _run(layer, x, False)
    assert y16.dtype == torch.bfloat16 and ga16.dtype == gb16.dtype == torch.float32
    for a, b in ((y16, y), (gx16, gx), (ga16, ga), (gb16, gb)):
        scale = float(b.detach().abs().max())
        torch.testing.assert_close(a.float(), b, atol=3 * 2**-8 * scale, rtol=0)


def test_fused_function_is_skipped_where_it_does_not_apply():
    layer = _lora_linear()
    assert layer._fusable()
    layer.lora_dropout, layer.dropout_p = nn.Dropout(0.1), 0.1
    assert not layer._fusable() and layer.eval()._fusable()
    layer = _lora_linear()
    layer.base.register_forward_hook(lambda *a: None)  # as tensor parallelism hooks its layers
    assert not layer._fusable()
    layer = _lora_linear()
    layer.base.bias.requires_grad_(True)
    assert not layer._fusable()


def _group(outs=(40, 16, 16), ranks=(4, 8, 4), bias=True, rslora=(False, True, False)) -> list[LoRALinear]:
    """Layers sharing one 24-wide input, as attention's q/k/v: different widths, ranks and scalings."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    return [
        LoRALinear(nn.Linear(24, out, bias=bias).requires_grad_(False), r=r, alpha=6, rslora=rs,
                   init="seeded", generator=gen).train()
        for out, r, rs in zip(outs, ranks, rslora)
    ]


def _run_group(layers: list[LoRALinear], x: torch.Tensor, grouped: bool, autocast: bool = False):
    x = x.clone().requires_grad_()
    for m in layers:
        m.lora_A.grad = m.lora_B.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ys = LoRALinear.project_group(x, layers) if grouped else [m(x) for m in layers]
    assert ys is not None
    gs = [torch.linspace(-1, 1, y.numel()).view_as(y) * (i + 1) for i, y in enumerate(ys)]
    sum((y.float() * g).sum() for y, g in zip(ys, gs)).backward()
    return [*ys, x.grad, *(p.grad for m in layers for p in (m.lora_A, m.lora_B))]


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_layers_equal_the_layers_one_by_one(bias):
    """project_group (the A's stacked, one input gradient buffer) gives each layer's output, the input
    gradient and every A/B gradient of the layers run one by one (fp32; float64 to 1e-12)."""
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        layers = [m.to(dtype) for m in _group(bias=bias)]
        x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(1), dtype=dtype)
        grouped, single = _run_group(layers, x, True), _run_group(layers, x, False)
        assert len(grouped) == 3 + 1 + 6
        for a, b in zip(grouped, single):
            assert a.dtype == b.dtype == dtype
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_grouped_layers_under_autocast():
    layers = _group()
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(1))
    got = _run_group(layers, x, True, autocast=True)
    want = _run_group(layers, x, False, autocast=True)
    assert got[0].dtype == torch.bfloat16 and all(t.dtype == torch.float32 for t in got[4:])
    for a, b in zip(got, want):  # the same bf16 products, summed in another order
        scale = float(b.detach().float().abs().max())
        torch.testing.assert_close(a.float(), b.float(), atol=2 * 2**-8 * scale, rtol=0)


def _add_dropout(layer: LoRALinear) -> None:
    layer.lora_dropout, layer.dropout_p = nn.Dropout(0.1), 0.1


def test_grouping_steps_aside_where_it_does_not_apply():
    x = torch.randn(2, 24)
    assert LoRALinear.project_group(x, _group()) is not None
    assert LoRALinear.project_group(x, _group()[:1]) is None  # one layer: its own function
    cases = {
        "disabled": lambda ms: setattr(ms[1], "disabled", True),
        "merged": lambda ms: ms[2].merge(),
        "hooked": lambda ms: ms[0].register_forward_hook(lambda *a: None),
        "dropout": lambda ms: _add_dropout(ms[1]),
        "fp64 adapter": lambda ms: ms[1].to(torch.float64),
    }
    for name, spoil in cases.items():
        layers = _group()
        spoil(layers)
        assert LoRALinear.project_group(x, layers) is None, name


def test_models_use_grouping_and_train_as_without_it(monkeypatch):
    """The model's q/k/v and gate/up go through project_group; a training step with it equals one
    with every layer on its own (fp32, 1e-6)."""
    calls = []
    group = LoRALinear.project_group

    def counted(x, layers):
        out = group(x, layers)
        calls.append(out is not None)
        return out

    grads = []
    for grouped in (True, False):
        off = staticmethod(lambda x, ls: None)
        monkeypatch.setattr(LoRALinear, "project_group", staticmethod(counted) if grouped else off)
        m = model(bias=True).train()
        apply_lora(m, "all-linear", r=4, alpha=8, init="seeded")
        F.cross_entropy(m(ids()).flatten(0, 1), ids(2).flatten()).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    assert calls == [True] * 4  # 2 blocks x (q/k/v, gate/up)
    for n, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][n], atol=1e-6, rtol=1e-6, msg=n)


def test_head_path_sees_the_adapted_output_weight():
    # A chunked loss takes the output layer's weight through `head=`: it must include the adapter.
    m = model()
    apply_lora(m, ["output", "wq"], r=4, alpha=8, dora=True, init="seeded")
    perturb_magnitudes(m)
    x = ids()
    logits = m(x)
    via_head = m(x, head=lambda hidden, weight: F.linear(hidden, weight))
    torch.testing.assert_close(via_head, logits, atol=ATOL, rtol=0)
    via_head.sum().backward()
    assert m.output.lora_magnitude.grad.abs().amax() > 0


class QuantizedBase(nn.Module):
    """The interface of a 4-bit base (finetune/nf4.py): no weight parameter, a dequantized_weight()."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("w", linear.weight.detach().to(torch.bfloat16))
        self.register_buffer("bias", linear.bias.detach().clone())

    def dequantized_weight(self) -> torch.Tensor:
        return self.w.float()

    def forward(self, x):
        return F.linear(x, self.dequantized_weight(), self.bias)


@pytest.mark.parametrize("dora", [False, True])
def test_quantized_base(dora):
    torch.manual_seed(0)
    q = QuantizedBase(nn.Linear(16, 8))
    layer = LoRALinear(q, r=2, alpha=4, dora=dora, init="seeded", generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 16)
    with torch.no_grad():
        merged = layer.merged_linear()
        assert isinstance(merged, nn.Linear) and not merged.weight.requires_grad
        torch.testing.assert_close(merged(x), layer(x), atol=1e-6, rtol=0)
    with pytest.raises(LmforgeError, match="merge_lora"):
        layer.merge()


@pytest.mark.parametrize("dora", [False, True])
def test_merged_for_inference_restores_every_weight_bit_for_bit(dora):
    m = model(bias=True)
    apply_lora(m, "all-linear", r=4, alpha=8, dora=dora, init="seeded")
    perturb_magnitudes(m)
    before = {n: t.clone() for n, t in m.state_dict().items()}
    x = ids()
    with torch.no_grad():
        ref = m(x)
        with merged_for_inference(m) as merged:
            assert merged and all(layer.merged for layer in lora_layers(m).values())
            torch.testing.assert_close(m(x), ref, atol=ATOL, rtol=0)
        with pytest.raises(RuntimeError, match="boom"), merged_for_inference(m):
            raise RuntimeError("boom")  # an error inside the block restores the weights too
    assert not any(layer.merged for layer in lora_layers(m).values())
    after = m.state_dict()
    assert all(torch.equal(after[n], t) for n, t in before.items())


def test_merged_for_inference_leaves_an_unmergeable_model_alone():
    m = model(bias=True)
    apply_lora(m, "all-linear", r=2, alpha=2)
    name = "layers.0.attn.wq"
    layer = lora_layers(m)[name]
    layer.base = QuantizedBase(layer.base)
    with merged_for_inference(m) as merged:
        assert not merged and not any(x.merged for x in lora_layers(m).values())
    with merged_for_inference(model()) as merged:  # no adapters at all
        assert not merged


def test_meta_model_is_refused():
    with torch.device("meta"):
        m = Transformer(cfg())
    with pytest.raises(LmforgeError, match="meta device"):
        apply_lora(m, "wq", r=2, alpha=2)


# ------------------------------------------------------------------------------------- peft files


@pytest.mark.parametrize("dora", [False, True])
def test_peft_files_round_trip(tmp_path, dora):
    m = model(bias=True)
    apply_lora(m, ["layers.0.attn.wq", "wk", "w_up"], r=4, alpha=8, dropout=0.1, dora=dora, init="seeded")
    perturb_magnitudes(m)
    save_peft_adapter(m, tmp_path, "base/model", m.cfg)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    # q_proj is wrapped in layer 0 only: named in full so that PEFT wraps exactly that one.
    assert config["target_modules"] == ["model.layers.0.self_attn.q_proj", "k_proj", "up_proj"]
    settings = (config["r"], config["lora_alpha"], config["lora_dropout"], config["use_dora"])
    assert settings == (4, 8, 0.1, dora)
    other = model(bias=True)
    assert load_peft_adapter(other, tmp_path) == [n for n in lora_layers(m)]
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(other.eval()(x), m.eval()(x), atol=0, rtol=0)
    for (n, p), (n2, p2) in zip(adapter_state_dict(m).items(), adapter_state_dict(other).items()):
        assert n == n2 and torch.equal(p, p2)


def test_gpt2_layout_is_refused(tmp_path):
    m = model(pos_embedding="learned", norm="layernorm", mlp="gelu_tanh")
    apply_lora(m, "wq", r=2, alpha=2)
    with pytest.raises(LmforgeError, match="Llama / Mistral / Qwen2.*GPT-2"):
        save_peft_adapter(m, tmp_path, None, m.cfg)
    with pytest.raises(LmforgeError, match="GPT-2"):
        load_peft_adapter(model(pos_embedding="learned", norm="layernorm", mlp="gelu_tanh"), tmp_path)


@pytest.fixture
def saved(tmp_path):
    m = model()
    apply_lora(m, "all-linear", r=4, alpha=8, init="seeded")
    save_peft_adapter(m, tmp_path, None, m.cfg)
    return tmp_path


def _edit(saved, **changes):
    file = saved / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(peft_type="IA3"), "peft_type='IA3' is not supported"),
        (dict(rank_pattern={"q_proj": 8}), "rank_pattern=.* is not supported"),
        (dict(bias="all"), "bias='all' is not supported"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save=.* is not supported"),
        (dict(r=0), "r=0 must be a positive integer"),
        (dict(target_modules=["c_attn"]), "matches none of the model's linear layers"),
        (dict(use_frobnicate=True), "unknown option.*use_frobnicate"),
    ],
)
def test_bad_adapter_config(saved, changes, message):
    _edit(saved, **changes)
    m = model()
    with pytest.raises(LmforgeError, match=message) as err:
        load_peft_adapter(m, saved)
    assert "adapter_config.json" in str(err.value)
    assert not lora_layers(m)  # nothing was changed


def test_adapter_for_another_model_size(saved):
    _edit(saved, r=2)
    m = model()
    key = r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight'"
    message = rf"adapter_model\.safetensors: tensor {key} has shape \(4, 32\), but the model needs \(2, 32\)"
    with pytest.raises(LmforgeError, match=message):
        load_peft_adapter(m, saved)
    assert not lora_layers(m)


def test_broken_adapter_files(saved):
    (saved / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(LmforgeError, match="not a readable safetensors file"):
        load_peft_adapter(model(), saved)
    (saved / "adapter_config.json").write_text("{not json")
    with pytest.raises(LmforgeError, match="adapter_config.json is not valid JSON"):
        load_peft_adapter(model(), saved)
    with pytest.raises(LmforgeError, match="has no adapter_config.json"):
        load_peft_adapter(model(), saved / "missing")


def test_adapters_disabled_gives_the_base_model_back():
    from lmforge.finetune.lora import adapters_disabled, merge_lora

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    want = base(x).detach()
    model = torch.nn.Sequential(*base)  # the same layers, wrapped in place below
    apply_lora(model, ["0", "2"], r=2, alpha=4.0, init="seeded", seed=1)
    adapted = model(x).detach()
    assert not torch.allclose(adapted, want)
    with adapters_disabled(model):
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    torch.testing.assert_close(model(x), adapted, rtol=0, atol=0)  # back on after the block
    with pytest.raises(RuntimeError), adapters_disabled(model):
        raise RuntimeError("inside")
    torch.testing.assert_close(model(x), adapted, rtol=0, atol=0)  # restored after an exception too
    merge_lora(model, reversible=True)
    with pytest.raises(LmforgeError, match="unmerge first"), adapters_disabled(model):
        model(x)
