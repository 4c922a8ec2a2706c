"""The `optim` section: one class per optimizer, chosen by `optim.name` (a discriminated union).

What every optimizer takes (lr, weight_decay) and what the Adam family shares (betas, eps, fused)
sit directly under `optim`; what one optimizer alone takes sits in its own subsection named after
it (`optim.muon.lr`, `optim.sophia.rho`, ...). A key the chosen optimizer does not take is an error
naming the valid keys, never silently ignored.

Configs written before the subsections existed used flat keys (`optim.muon_lr`, `optim.sophia_rho`,
...) and listed every optimizer's keys whatever the name. `migrate_flat_optim` still reads them:
each key of the chosen optimizer moves to its new place, the other optimizers' keys are dropped
(they never did anything), and the caller prints one deprecation note naming the new keys.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from lmforge.config.section import Section
from lmforge.errors import LmforgeDeprecationWarning

Betas = tuple[float, float]


MAX_GROUP_RULES = 64  # optim.param_groups: more rules than any model's modules need
MAX_PATTERN_CHARS = 256


class ParamGroupRule(Section):
    """One rule of optim.param_groups: the parameters whose name matches `match` take these settings."""

    match: str = Field(
        description="Glob over parameter names as model.named_parameters() gives them "
        "(layers.0.attn.wq.weight), wrapper prefixes (DDP's module., compile's _orig_mod.) removed: * any "
        "run of characters (dots included), ? one, [ab] a set. The first rule that matches a parameter "
        "takes it.",
        min_length=1, max_length=MAX_PATTERN_CHARS,
    )
    weight_decay: float | None = Field(
        None, ge=0.0, description="Weight decay of the matched parameters (None: as optim.weight_decay and "
        "the no-decay split give them)."
    )
    lr_scale: float = Field(
        1.0, gt=0.0, description="Multiplier of the matched parameters' lr (it scales the scheduled lr)."
    )

    @model_validator(mode="after")
    def _check(self):
        if self.weight_decay is None and self.lr_scale == 1.0:
            raise ValueError(f"optim.param_groups rule match={self.match!r} changes nothing: give it "
                             "weight_decay and/or lr_scale")
        return self


class _Base(Section):
    name: str = Field(
        description="Optimizer: adamw, adam (L2 decay), sgd, lion, adafactor, adamw8bit (block-wise "
        "8-bit moments), sophia (clipped Hessian-diagonal preconditioning), muon (orthogonalised "
        "momentum on 2-D hidden weights, adamw on the rest)."
    )
    lr: float = Field(3e-4, gt=0.0, description="Peak learning rate (adafactor relative_step: ignored).")
    weight_decay: float = Field(
        0.1, ge=0.0, description="Weight decay (never applied to norms, biases, embeddings); L2 for adam/sgd."
    )
    param_groups: list[ParamGroupRule] = Field(
        default_factory=list, max_length=MAX_GROUP_RULES,
        description="Per-module settings by parameter-name glob, first match wins, e.g. [{match: "
        "'*norm*', weight_decay: 0}, {match: 'tok_embeddings.*', lr_scale: 0.1}]; a rule that matches no "
        "trainable parameter is an error."
    )


class _AdamFamily(_Base):
    betas: Betas = Field((0.9, 0.95), description="First and second moment decay rates beta1, beta2.")
    eps: float = Field(1e-8, gt=0.0, description="Epsilon added to the denominator.")

    @model_validator(mode="after")
    def _check_betas(self):
        for b in self.betas:
            if not 0.0 <= b < 1.0:
                raise ValueError(f"optim.betas must lie in [0, 1), got {list(self.betas)}")
        return self


class AdamWConfig(_AdamFamily):
    name: Literal["adamw"] = Field(
        "adamw", description="AdamW (decoupled weight decay), torch's fused kernel where the device has one."
    )
    fused: bool | None = Field(None, description="Fused kernel (None: where the device supports it).")


class AdamConfig(_AdamFamily):
    name: Literal["adam"] = Field("adam", description="Adam with L2 weight decay (coupled to the gradient).")
    fused: bool | None = Field(None, description="Fused kernel (None: where the device supports it).")


class SGDSettings(Section):
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="Momentum (0: plain SGD, no state).")
    nesterov: bool = Field(False, description="Nesterov momentum (needs momentum > 0).")

    @model_validator(mode="after")
    def _check(self):
        if self.nesterov and self.momentum <= 0.0:
            raise ValueError("optim.sgd.nesterov needs optim.sgd.momentum > 0")
        return self


class SGDConfig(_Base):
    name: Literal["sgd"] = Field("sgd", description="SGD with momentum / Nesterov (settings in optim.sgd).")
    sgd: SGDSettings = Field(default_factory=SGDSettings, description="SGD's own settings.")


class LionConfig(_Base):
    name: Literal["lion"] = Field(
        "lion",
        description="Lion: sign of interpolated momentum, 4 bytes of state; use a 3-10x smaller lr than "
        "AdamW.",
    )
    betas: Betas = Field((0.9, 0.95), description="Lion beta1 (update interpolation), beta2 (momentum); the "
                         "Lion paper uses 0.9, 0.99.")

    @model_validator(mode="after")
    def _check_betas(self):
        return _AdamFamily._check_betas(self)


class AdafactorSettings(Section):
    beta1: float | None = Field(
        None, ge=0.0, lt=1.0, description="First-moment decay (None: no first moment)."
    )
    eps: tuple[float, float] = Field(
        (1e-30, 1e-3), description="eps added to g^2, and floor of the parameter scale."
    )
    relative_step: bool = Field(
        False, description="Step size min(1e-2, 1/sqrt(t)) instead of lr (the schedule is ignored)."
    )
    scale_parameter: bool = Field(False, description="Scale the step by the parameter RMS.")
    warmup_init: bool = Field(False, description="Relative step warm-up 1e-6*t (needs relative_step).")
    clip_threshold: float = Field(1.0, gt=0.0, description="Clip the update to this RMS.")
    decay_rate: float = Field(-0.8, lt=0.0, description="Second-moment rate: beta2_t = 1 - t^decay_rate.")

    @model_validator(mode="after")
    def _check(self):
        if self.warmup_init and not self.relative_step:
            raise ValueError("optim.adafactor.warmup_init needs optim.adafactor.relative_step")
        return self


class AdafactorConfig(_Base):
    name: Literal["adafactor"] = Field(
        "adafactor", description="Adafactor: factored second moments (settings in optim.adafactor)."
    )
    adafactor: AdafactorSettings = Field(
        default_factory=AdafactorSettings, description="Adafactor's settings."
    )


class AdamW8bitSettings(Section):
    block_size: int = Field(
        256, ge=16, description="Elements per quantisation block (one absmax scale each)."
    )
    min_size: int = Field(4096, ge=0, description="Tensors with fewer elements keep fp32 moments.")
    backend: Literal["auto", "torch", "bitsandbytes"] = Field(
        "auto", description="Kernel: bitsandbytes on CUDA when installed and block_size=256 (auto), else "
        "pure PyTorch."
    )


class AdamW8bitConfig(_AdamFamily):
    name: Literal["adamw8bit"] = Field(
        "adamw8bit", description="AdamW with block-wise 8-bit moments (settings in optim.adamw8bit)."
    )
    adamw8bit: AdamW8bitSettings = Field(default_factory=AdamW8bitSettings,
                                         description="8-bit AdamW's quantisation settings.")


class SophiaSettings(Section):
    rho: float = Field(0.04, gt=0.0, description="Clipping scale rho of the preconditioned step.")
    hessian_every: int = Field(10, ge=1, description="Estimate the Hessian diagonal every k steps (after "
                               "steps 1, 1+k, ...).")
    estimator: Literal["gnb", "hutchinson"] = Field(
        "gnb", description="Hessian-diagonal estimate: Gauss-Newton-Bartlett or Hutchinson."
    )


class SophiaConfig(_AdamFamily):
    name: Literal["sophia"] = Field(
        "sophia",
        description="SophiaG: clipped, Hessian-diagonal preconditioned steps (settings in optim.sophia).",
    )
    betas: Betas = Field((0.9, 0.95), description="Gradient EMA beta1; Hessian EMA beta2 (the Sophia paper "
                         "uses 0.965, 0.99).")
    eps: float = Field(1e-8, gt=0.0, description="Floor of rho*h in the denominator.")
    sophia: SophiaSettings = Field(default_factory=SophiaSettings, description="Sophia's own settings.")


class MuonSettings(Section):
    lr: float = Field(0.02, gt=0.0, description="Peak lr of the 2-D hidden weights (the schedule applies).")
    momentum: float = Field(0.95, ge=0.0, lt=1.0, description="Momentum.")
    nesterov: bool = Field(True, description="Nesterov momentum.")
    ns_steps: int = Field(5, ge=1, description="Newton-Schulz iterations.")


class MuonConfig(_AdamFamily):
    name: Literal["muon"] = Field("muon", description="Muon on the hidden matrices (settings in optim.muon), "
                                  "AdamW (lr, betas, eps) on embeddings, head, norms and biases.")
    fused: bool | None = Field(None, description="Fused AdamW kernel for the AdamW groups.")
    muon: MuonSettings = Field(default_factory=MuonSettings, description="Muon's own settings.")


OPTIMIZER_CONFIGS: dict[str, type[_Base]] = {
    "adamw": AdamWConfig, "adam": AdamConfig, "sgd": SGDConfig, "lion": LionConfig,
    "adafactor": AdafactorConfig, "adamw8bit": AdamW8bitConfig, "sophia": SophiaConfig, "muon": MuonConfig,
}



def _before(value: Any) -> Any:
    """Default name (adamw) and the flat pre-subsection keys, before the union picks a class."""
    if isinstance(value, dict):
        value, notes = migrate_flat_optim(value)
        if notes:
            warnings.warn(LmforgeDeprecationWarning(
                "flat optim keys are deprecated; they still work in this release: " + "; ".join(notes)
                + " (print the current form with: lmforge config -c FILE)"), stacklevel=2)
        if "name" not in value:
            value = {**value, "name": "adamw"}
    return value


OptimConfig = Annotated[
    AdamWConfig | AdamConfig | SGDConfig | LionConfig | AdafactorConfig | AdamW8bitConfig | SophiaConfig
    | MuonConfig,
    Field(discriminator="name"),
    BeforeValidator(_before),
]

# Retired flat key -> (optimizer whose key it is, its new dotted place under optim). The Adam family's
# shared keys (betas, eps, fused) kept their place; in a flat config they belonged to every optimizer.
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "momentum": ("sgd", "sgd.momentum"), "nesterov": ("sgd", "sgd.nesterov"),
    "adafactor_beta1": ("adafactor", "adafactor.beta1"), "adafactor_eps": ("adafactor", "adafactor.eps"),
    "relative_step": ("adafactor", "adafactor.relative_step"),
    "scale_parameter": ("adafactor", "adafactor.scale_parameter"),
    "warmup_init": ("adafactor", "adafactor.warmup_init"),
    "clip_threshold": ("adafactor", "adafactor.clip_threshold"),
    "decay_rate": ("adafactor", "adafactor.decay_rate"),
    "quant_block_size": ("adamw8bit", "adamw8bit.block_size"),
    "quant_min_size": ("adamw8bit", "adamw8bit.min_size"),
    "quant_backend": ("adamw8bit", "adamw8bit.backend"),
    "sophia_rho": ("sophia", "sophia.rho"), "hessian_every": ("sophia", "sophia.hessian_every"),
    "hessian_estimator": ("sophia", "sophia.estimator"),
    "muon_lr": ("muon", "muon.lr"), "muon_momentum": ("muon", "muon.momentum"),
    "muon_nesterov": ("muon", "muon.nesterov"), "muon_ns_steps": ("muon", "muon.ns_steps"),
}


def migrate_flat_optim(optim: Any) -> tuple[Any, list[str]]:
    """An `optim` mapping in the pre-subsection (flat) form -> the current form, and notes for the
    user ("optim.muon_lr -> optim.muon.lr"). A mapping without retired keys comes back unchanged.

    In the flat form every optimizer's keys were accepted (and ignored unless they were the chosen
    optimizer's), and a saved config.yaml listed them all: only the chosen optimizer's keys move,
    the rest are dropped. A `name` missing from the mapping means the default, adamw.
    """
    if not isinstance(optim, dict) or not any(k in FLAT_KEYS for k in optim):
        return optim, []
    name = optim.get("name", "adamw")
    cls = OPTIMIZER_CONFIGS.get(name)
    if cls is None:
        return optim, []  # validation names the valid optimizers
    out: dict[str, Any] = {}
    notes, dropped = [], []
    for key, value in optim.items():
        if key in FLAT_KEYS:
            owner, new = FLAT_KEYS[key]
            if owner != name:
                dropped.append(key)
                continue
            section, sub = new.split(".")
            out.setdefault(section, {})[sub] = value
            notes.append(f"optim.{key} -> optim.{new}")
        elif key in cls.model_fields or key == "name":
            out[key] = value
        else:
            dropped.append(key)  # a shared key (betas, eps, fused) this optimizer does not take
    if dropped:
        shown = ", ".join(f"optim.{k}" for k in dropped[:3]) + (
            f" and {len(dropped) - 3} more" if len(dropped) > 3 else ""
        )
        notes.append(f"ignored (optim.name={name} does not use them): {shown}")
    return out, notes


def optim_config(**fields: Any) -> _Base:
    """The `optim` section from keyword fields, validated as the config file's section is:
    optim_config(name="muon", lr=1e-3, muon={"lr": 0.03})."""
    from pydantic import TypeAdapter

    return TypeAdapter(OptimConfig).validate_python(fields)
