"""LoRA (Hu et al. 2021) and DoRA (Liu et al. 2024) adapters on the linear layers of a model.

`apply_lora(model, targets, ...)` replaces each targeted linear layer by a `LoRALinear` that keeps
the original layer as `.base` and adds trainable `lora_A` (r, in), `lora_B` (out, r) and, with DoRA,
`lora_magnitude` (out,); every other parameter of the model is frozen. Parameter names become
`layers.0.attn.wq.base.weight`, `layers.0.attn.wq.lora_A`, ... `merge_lora` folds the adapters back
into plain `nn.Linear` layers, so the model's state_dict has its original names again and the
checkpoint / Hugging Face export code applies unchanged.

The maths are PEFT's (`peft.tuners.lora.layer.Linear` and `peft.tuners.lora.dora.DoraLinearLayer`),
initialisation and DoRA's handling of dropout and bias included, so adapters round-trip through
PEFT's file format (finetune/peft_io.py) with equal logits.

Apply adapters to a materialised model (after `init_weights` or loading weights, not on the meta
device): A's initialisation and DoRA's magnitude need the real base weights, and
`Transformer.init_weights` does not know the adapter parameters. Apply them before parallelising
(DDP, FSDP, torch.compile), as any change of the module tree: the adapters are plain parameters and
their forward has no data-dependent Python branches.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import ConfigError, LmforgeError
from lmforge.finetune import t5_lora
from lmforge.finetune.lora_fused import LoRAGroupFn, LoRALinearFn, compute_dtype

# Hugging Face (Llama / Mistral / Qwen2, DeepSeek-V3) module names accepted as targets, as suffixes of ours.
HF_TARGETS = {
    "q_proj": "attn.wq",
    "k_proj": "attn.wk",
    "v_proj": "attn.wv",
    "o_proj": "attn.wo",
    "gate_proj": "mlp.w_gate",
    "up_proj": "mlp.w_up",
    "down_proj": "mlp.w_down",
    "lm_head": "output",
    # Phi-3's fused modules: every projection they hold (PEFT export fuses the adapters back).
    "qkv_proj": ("attn.wq", "attn.wk", "attn.wv"),
    "gate_up_proj": ("mlp.w_gate", "mlp.w_up"),
    # DeepSeek-V3's multi-head latent attention (models/common/mla.py)
    "q_a_proj": "attn.wq_a",
    "q_b_proj": "attn.wq_b",
    "kv_a_proj_with_mqa": "attn.wkv_a",
    "kv_b_proj": "attn.wkv_b",
}
ALL_LINEAR = "all-linear"
ADAPTER_PARAMS = ("lora_A", "lora_B", "lora_magnitude")
INITS = ("default", "seeded")


def _is_linear(module: nn.Module) -> bool:
    # A 4-bit base (finetune/nf4.py) is no nn.Linear but offers its weight through dequantized_weight().
    return isinstance(module, nn.Linear) or callable(getattr(module, "dequantized_weight", None))


class LoRALinear(nn.Module):
    """y = base(x) + B A dropout(x) * scaling, with a frozen `base` and trainable A (r, in), B (out, r).

    base: an nn.Linear, or any module with in_features, out_features, bias (tensor or None), forward(x)
        and dequantized_weight() (a quantized base).
    scaling: alpha / r, or alpha / sqrt(r) with rslora (Kalajdzievski 2023).
    dora: y = m / ||W + s B A||_row * (W x + s B A dropout(x)) + bias, where the magnitude m (out,) is
        trainable and starts at ||W + s B A|| of the initial adapters; the norm is a constant for autograd
        (the DoRA paper's section 4.3). With dropout active (training) it is PEFT's
        y = base(x) + (m/n - 1) W dropout(x) + (m/n) s B A dropout(x), n = ||W + s B A||_row.
    init: "default" (PEFT: A kaiming-uniform(a=sqrt(5)) from the global RNG, B = 0, so the model is
        unchanged), "seeded" (A and B both nonzero from `generator`, same distributions as PEFT's
        init_lora_weights=False), or None (zeros: values about to be loaded).
    The adapter computes in `dtype` (float32 by default) and adds its result in the base's dtype.
    """

    def __init__(
        self,
        base: nn.Module,
        r: int,
        alpha: float,
        *,
        dropout: float = 0.0,
        rslora: bool = False,
        dora: bool = False,
        dtype: torch.dtype = torch.float32,
        init: str | None = "default",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        tensors = [*base.parameters(), *base.buffers()]
        if any(t.is_meta for t in tensors):
            raise LmforgeError(
                "LoRA needs a materialised model: its base weights are on the meta device. Materialise "
                "it first (to_empty + init_weights, or load a checkpoint), then apply the adapters"
            )
        device = tensors[0].device if tensors else torch.device("cpu")
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.alpha, self.rslora, self.dropout_p = r, alpha, rslora, dropout
        self.scaling = alpha / (math.sqrt(r) if rslora else r)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Parameter(torch.zeros(r, self.in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, device=device, dtype=dtype))
        self._init_adapters(init, generator)
        self.lora_magnitude: nn.Parameter | None = None
        if dora:
            with torch.no_grad():
                weight = self._base_weight().to(dtype)
                self.lora_magnitude = nn.Parameter(self._row_norm(weight, self.lora_B @ self.lora_A))
        self.merged = False
        self._unmerged_weight: torch.Tensor | None = None  # held while merged, so unmerge is exact
        self.disabled = False  # forward is the base alone (`adapters_disabled`: a reference model)

    @torch.no_grad()
    def _init_adapters(self, init: str | None, generator: torch.Generator | None) -> None:
        if init == "default":
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        elif init == "seeded":
            # The bounds of nn.Linear's own init (kaiming-uniform, a=sqrt(5)): 1 / sqrt(fan_in).
            for p, fan_in in ((self.lora_A, self.in_features), (self.lora_B, self.r)):
                bound = 1.0 / math.sqrt(fan_in)
                value = torch.empty(p.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
                p.copy_(value)
        else:
            assert init is None, f"unknown LoRA init {init!r}"

    @property
    def dora(self) -> bool:
        return self.lora_magnitude is not None

    def _base_weight(self) -> torch.Tensor:
        if isinstance(self.base, nn.Linear):
            return self.base.weight
        return self.base.dequantized_weight()

    def _row_norm(self, weight: torch.Tensor, lora_weight: torch.Tensor) -> torch.Tensor:
        """||W + s B A|| over the input dimension, one value per output row (out,)."""
        return torch.linalg.norm(weight + self.scaling * lora_weight, dim=1)

    def _fusable(self) -> bool:
        """Whether the fused LoRA function computes this layer: a plain nn.Linear base with a frozen
        plain-tensor weight that nothing hooks (tensor parallelism hooks the base and shards it into
        DTensors: it goes through base(x)), no DoRA and no active dropout."""
        base = self.base
        return (
            type(base) is nn.Linear
            and not base.weight.requires_grad
            and (base.bias is None or not base.bias.requires_grad)
            and type(base.weight.data) is torch.Tensor
            and not (base._forward_hooks or base._forward_pre_hooks)
            and self.lora_magnitude is None
            and not (self.training and self.dropout_p > 0)
        )

    @staticmethod
    def project_group(x: torch.Tensor, layers: Sequence[LoRALinear]) -> tuple[torch.Tensor, ...] | None:
        """[layer(x) for layer in layers] in one fused function (models/common/linear.py's protocol),
        or None where that does not apply: every layer fusable, unhooked, enabled, unmerged, with base
        weights and adapters of one dtype each, on the CPU. The A's are stacked into one (sum r, in)
        matrix, so x is read once for all adapters in the forward and once for all A gradients in the
        backward, and the input gradient of the group is one buffer the layers' products are added
        into. On the CPU (2 cores, MKL) the adapters of a LoRA step on all seven linear kinds then cost
        81.5 instead of 105.5 ms at d 512 (2.1% of the step), 1.0% of the step at d 256. Not used on a
        GPU yet: the per-layer path is the one measured there."""
        if len(layers) < 2 or x.device.type != "cpu":
            return None  # one layer: its own function; on a GPU the per-layer path measured on an H100
        first = layers[0]
        for m in layers:
            if (m.disabled or m.merged or m._forward_hooks or m._forward_pre_hooks or not m._fusable()
                    or m.base.weight.dtype != first.base.weight.dtype
                    or m.lora_A.dtype != first.lora_A.dtype or m.lora_B.dtype != first.lora_B.dtype):
                return None
        dtype = compute_dtype(x, first.base.weight)
        weights = tuple(m.base.weight.to(dtype) for m in layers)
        biases = tuple(None if m.base.bias is None else m.base.bias.to(dtype) for m in layers)
        scalings = tuple(m.scaling for m in layers)
        adapters = [p for m in layers for p in (m.lora_A, m.lora_B)]
        return LoRAGroupFn.apply(x.to(dtype), weights, biases, scalings, *adapters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.disabled:
            if self.merged:
                raise LmforgeError("adapters cannot be disabled while merged into the base: unmerge first")
            return self.base(x)
        if not self.merged and self._fusable():
            dtype = compute_dtype(x, self.base.weight)
            bias = self.base.bias
            return LoRALinearFn.apply(
                x.to(dtype), self.base.weight.to(dtype), None if bias is None else bias.to(dtype),
                self.lora_A, self.lora_B, self.scaling,
            )
        result = self.base(x)
        if self.merged:
            return result
        x = x.to(self.lora_A.dtype)
        if self.lora_magnitude is None:
            lora = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B) * self.scaling
            return result + lora.to(result.dtype)
        return result + self._dora_delta(x, result).to(result.dtype)

    def _dora_delta(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """What DoRA adds to base(x): (m/n - 1) W x + (m/n) s B A x, as PEFT's DoraLinearLayer."""
        weight = self._base_weight().to(x.dtype)
        norm = self._row_norm(weight, (self.lora_B @ self.lora_A).detach()).detach()  # (out,)
        scale = self.lora_magnitude / norm  # (out,)
        if self.training and self.dropout_p > 0:
            # base(x) saw the undropped input; the correction of W x must see the dropped one.
            x = self.lora_dropout(x)
            base_out = F.linear(x, weight)
        else:
            # W x without a second matmul: the base's output minus its bias.
            bias = self.base.bias
            base_out = result if bias is None else result - bias
        lora_out = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return (scale - 1) * base_out + scale * lora_out * self.scaling

    def _merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """W + s B A (DoRA: scaled row-wise to the magnitude), in the adapter dtype; `weight` is the
        unmerged base weight."""
        w = weight.to(self.lora_A.dtype) + (self.lora_B @ self.lora_A) * self.scaling
        if self.lora_magnitude is None:
            return w
        return (self.lora_magnitude / torch.linalg.norm(w, dim=1).detach()).view(-1, 1) * w

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight (out, in) in the base's dtype, differentiable in the adapters.

        For callers that use a layer's weight directly (the Transformer's `head=` path for a loss
        over chunks): it equals forward without the bias and without LoRA dropout.
        """
        if self.merged:
            return self.base.weight
        base = self._base_weight()
        return self._merged_weight(base).to(base.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the adapters into the base weight in place (forward is then the base alone); `unmerge`
        restores the exact original weight. While merged, `base.weight` in the state_dict is the merged
        weight: save adapters or checkpoints unmerged."""
        if self.merged:
            return
        if not isinstance(self.base, nn.Linear):
            raise LmforgeError(
                f"cannot merge LoRA into a {type(self.base).__name__} base in place (a quantized weight "
                "cannot hold the sum); use merge_lora(model), which replaces the layer by a dense one"
            )
        weight = self.base.weight
        self._unmerged_weight = weight.data
        weight.data = self._merged_weight(weight.data).to(weight.dtype)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo `merge`: the base weight is the original tensor again, bit for bit."""
        if not self.merged:
            return
        assert self._unmerged_weight is not None
        self.base.weight.data = self._unmerged_weight
        self._unmerged_weight = None
        self.merged = False

    @torch.no_grad()
    def merged_linear(self) -> nn.Linear:
        """A new frozen nn.Linear computing what this layer computes (without dropout), in the base's
        dtype; a quantized base is dequantized."""
        base = self._base_weight()
        weight = base if self.merged else self._merged_weight(base)
        bias = self.base.bias
        out = nn.Linear(self.in_features, self.out_features, bias=bias is not None, device="meta")
        out.to_empty(device=base.device)  # no default init: it would draw random numbers for nothing
        out.weight = nn.Parameter(weight.to(base.dtype).clone(), requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return out

    def extra_repr(self) -> str:
        kind = "DoRA" if self.dora else "LoRA"
        return f"{kind} r={self.r}, alpha={self.alpha}, rslora={self.rslora}, dropout={self.dropout_p}"


# ------------------------------------------------------------------------------------ model level


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """{module name: LoRALinear} of the model, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def linear_names(model: nn.Module) -> list[str]:
    """Names of the linear layers adapters can target, wrapped ones under their own name (not `.base`)."""
    names: list[str] = []
    for name, m in model.named_modules():
        if names and name.startswith(names[-1] + "."):
            continue  # inside a layer already listed (the base of a LoRALinear)
        if isinstance(m, LoRALinear) or _is_linear(m):
            names.append(name)
    return names


def target_table(model: nn.Module) -> dict:
    """The Hugging Face module names `model` takes as LoRA targets: T5's on an encoder-decoder."""
    return t5_lora.TARGETS if t5_lora.is_t5(model) else HF_TARGETS


def _matches(name: str, pattern: str, table: dict = HF_TARGETS) -> bool:
    if pattern == ALL_LINEAR:
        # Every block linear, as PEFT's all-linear: the output head is left out, and so is a mixture of
        # experts' router (no Linear layer in transformers 5, so no PEFT adapter can hold it). A T5's
        # blocks are in its two stacks (finetune/t5_lora.py).
        blocks = t5_lora.BLOCKS if table is t5_lora.TARGETS else ("layers.",)
        return name.startswith(blocks) and not name.endswith(".moe.router.gate")
    pattern = table.get(pattern, pattern)
    if isinstance(pattern, tuple):
        return any(_matches(name, p, table) for p in pattern)
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def match_targets(names: Sequence[str], targets: str | Sequence[str], table: dict = HF_TARGETS) -> list[str]:
    """The names (in their order) matched by any of `targets`; ConfigError for a pattern matching none.

    A pattern is an fnmatch glob over the full name ("layers.*.attn.wq"), a name or dotted suffix ("wq",
    "attn.wq", "layers.0.mlp.w_up"), a Hugging Face name ("q_proj", ..., "lm_head") or "all-linear".
    `table` holds the Hugging Face names: the decoder families' (HF_TARGETS) or T5's (`target_table`).
    """
    targets = [targets] if isinstance(targets, str) else list(targets)
    if table is t5_lora.TARGETS:
        t5_lora.check_targets(targets)
    if not targets:
        raise ConfigError(
            "no LoRA target modules given; name some, e.g. ['q_proj', 'v_proj'], or give 'all-linear'"
        )
    chosen: set[str] = set()
    for pattern in targets:
        hits = [n for n in names if _matches(n, pattern, table)]
        if not hits:
            shapes = list(dict.fromkeys(re.sub(r"(?<=\.)\d+(?=\.)", "{i}", n) for n in names))
            raise ConfigError(
                f"LoRA target {pattern!r} (of {targets}) matches no linear layer of the model; its linear "
                f"layers are: {', '.join(shapes)}. Use a glob over these names, a suffix such as 'wq', a "
                f"Hugging Face name ({', '.join(table)}) or 'all-linear'"
            )
        chosen.update(hits)
    return [n for n in names if n in chosen]


def apply_lora(
    model: nn.Module,
    targets: str | Sequence[str],
    *,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    rslora: bool = False,
    dora: bool = False,
    dtype: torch.dtype = torch.float32,
    init: str = "default",
    seed: int = 0,
) -> list[str]:
    """Wrap the linear layers matched by `targets` (see `match_targets`) in LoRALinear, freeze every
    other parameter, and return the wrapped names. init="seeded" draws nonzero A and B from `seed`.
    The model must be materialised (not on the meta device) and must not carry adapters yet."""
    if init not in INITS:
        raise ConfigError(f"LoRA init={init!r} is not one of {', '.join(INITS)}")
    return wrap_layers(model, targets, r=r, alpha=alpha, dropout=dropout, rslora=rslora, dora=dora,
                       dtype=dtype, init=init, seed=seed)


def wrap_layers(
    model: nn.Module,
    targets: str | Sequence[str],
    *,
    r: int,
    alpha: float,
    dropout: float,
    rslora: bool,
    dora: bool,
    dtype: torch.dtype,
    init: str | None,
    seed: int = 0,
) -> list[str]:
    """`apply_lora`, plus init=None: zero adapters whose values are about to be loaded (peft_io)."""
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ConfigError(f"LoRA rank r={r!r}; it must be a positive integer (8 or 16 are common)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ConfigError(f"LoRA alpha={alpha!r}; it must be a finite number (often 2 * r)")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"LoRA dropout={dropout!r}; it must lie in [0, 1)")
    existing = lora_layers(model)
    if existing:
        raise ConfigError(
            f"the model already carries LoRA adapters on {len(existing)} layers ({next(iter(existing))}, "
            "...); give all targets in one call, or merge_lora(model) first"
        )
    names = match_targets(linear_names(model), targets, target_table(model))
    generator = torch.Generator().manual_seed(seed) if init == "seeded" else None
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = LoRALinear(getattr(parent, leaf), r, alpha, dropout=dropout, rslora=rslora, dora=dora,
                           dtype=dtype, init=init, generator=generator)
        setattr(parent, leaf, layer)
    model.requires_grad_(False)
    for layer in lora_layers(model).values():
        for p in layer.parameters(recurse=False):
            p.requires_grad_(True)
    return names


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, every LoRA/DoRA layer of `model` computes its base alone and trainable token
    rows read the frozen table's own: the model is the frozen model the adapters started from (PEFT's
    `disable_adapter`), e.g. the reference model of preference training at no extra memory. Restored
    on exit, exceptions included."""
    from lmforge.finetune.token_rows import RowOverride

    layers = [m for m in model.modules() if isinstance(m, (LoRALinear, RowOverride))]
    before = [m.disabled for m in layers]
    for m in layers:
        m.disabled = True
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.disabled = was


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, under their names in the model (`layers.0.attn.wq.lora_A`, ...)."""
    return {
        f"{name}.{pname}": p.detach()
        for name, layer in lora_layers(model).items()
        for pname, p in layer.named_parameters(recurse=False)
    }


def merge_lora(model: nn.Module, *, reversible: bool = False) -> nn.Module:
    """Fold every adapter into its layer and return the model.

    Default: each LoRALinear is replaced by its merged, frozen nn.Linear, so the state_dict has the
    original names (`layers.0.attn.wq.weight`) for checkpoint and Hugging Face export. reversible=True
    keeps the LoRALinear layers and merges their weights in place (`unmerge_lora` undoes it exactly).
    """
    for name, layer in lora_layers(model).items():
        if reversible:
            layer.merge()
            continue
        parent_name, _, leaf = name.rpartition(".")
        assert leaf, "merge_lora takes the model that holds the LoRA layers, not a LoRALinear itself"
        setattr(model.get_submodule(parent_name), leaf, layer.merged_linear())
    return model


@contextlib.contextmanager
def merged_for_inference(model: nn.Module) -> Iterator[bool]:
    """Within the block every adapter is folded into its base weight (one GEMM per layer instead of
    three: sampling many tokens is faster), and afterwards each base weight is its original tensor again,
    bit for bit. Yields whether it merged: layers that cannot merge in place (a quantized base, a base
    sharded as DTensors, a disabled adapter) leave the whole model as it is."""
    layers = list(lora_layers(model).values())
    mergeable = bool(layers) and all(
        type(m.base) is nn.Linear and type(m.base.weight.data) is torch.Tensor and not m.merged
        and not m.disabled for m in layers
    )
    if not mergeable:
        yield False
        return
    done = []
    try:
        with torch.no_grad():
            for m in layers:
                m.merge()
                done.append(m)
        yield True
    finally:
        for m in done:
            m.unmerge()


def unmerge_lora(model: nn.Module) -> nn.Module:
    """Undo `merge_lora(model, reversible=True)`: every base weight is its original tensor again."""
    for layer in lora_layers(model).values():
        layer.unmerge()
    return model


def adapter_settings(model: nn.Module) -> dict[str, Any]:
    """The settings all adapters of the model share: r, alpha, dropout, rslora, dora (LmforgeError when
    they differ, or when there are none)."""
    layers = lora_layers(model)
    if not layers:
        raise LmforgeError("the model has no LoRA adapters (apply_lora or load_peft_adapter adds them)")
    settings = {
        name: {"r": m.r, "alpha": m.alpha, "dropout": m.dropout_p, "rslora": m.rslora, "dora": m.dora}
        for name, m in layers.items()
    }
    first_name, first = next(iter(settings.items()))
    for name, s in settings.items():
        if s != first:
            raise LmforgeError(
                f"LoRA layers differ in their settings ({first_name}: {first}; {name}: {s}); one adapter "
                "file holds one setting for all layers"
            )
    return first
