"""One spec per optimizer: how to build it from its config section, where it can run, what it
needs after each update and how much memory it holds. Drivers (the assembly, the lr finder, the
memory estimator, benchmarks) ask the spec; nothing outside this package names an optimizer.

    spec = SPECS[cfg.optim.name]
    optimizer = build_optimizer(model, cfg.optim)
    problems = spec.capabilities(cfg.optim).problems(...)       # refuse a layout before any work
    hooks = spec.hooks(optimizer)                               # passed to the step (Sophia's Hessian)
    spec.memory.state_bytes(tensor, cfg.optim, "cuda")          # bytes of state (optim/memory.py)
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lmforge.config.optim import (
    OPTIMIZER_CONFIGS,
    AdafactorConfig,
    AdamConfig,
    AdamW8bitConfig,
    AdamWConfig,
    LionConfig,
    MuonConfig,
    OptimConfig,
    ParamGroupRule,
    SGDConfig,
    SophiaConfig,
)
from lmforge.engine.step import StepHook
from lmforge.errors import CheckpointMismatchError, ConfigError
from lmforge.optim.adafactor import Adafactor
from lmforge.optim.adamw8bit import AdamW8bit, bitsandbytes_adamw8bit, use_bitsandbytes
from lmforge.optim.lion import Lion
from lmforge.optim.memory import MEMORY, MemoryFacts
from lmforge.optim.muon import MuonAdamW, hidden_matrices, split_muon_groups
from lmforge.optim.sophia import HessianRefresh, Sophia


@dataclass(frozen=True)
class Capabilities:
    """Where an optimizer can run. Each field is None where it can, else the reason it cannot (the
    start-up error quotes it)."""

    sharded: str | None = None  # parameters sharded by FSDP (parallel.dp_shard > 1) or TP
    pipeline: str | None = None  # model split into pipeline stages (parallel.pp > 1)
    data_parallel: str | None = None  # any data parallelism
    zero1: str | None = None  # optimizer state partitioned over ranks (parallel.zero=1)
    non_token_objective: str | None = None  # objectives whose loss is not per token (pairs, ...)
    fixed_lr: str | None = None  # it computes its own step size and ignores the lr it is given


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    build: Callable[[nn.Module, list[dict], OptimConfig], torch.optim.Optimizer]
    memory: MemoryFacts
    capabilities: Callable[[OptimConfig], Capabilities] = lambda cfg: Capabilities()
    hooks: Callable[[torch.optim.Optimizer], list[StepHook]] = field(default=lambda optimizer: [])


def param_groups(model: nn.Module, weight_decay: float, rules: Sequence[ParamGroupRule] = ()) -> list[dict]:
    """Split parameters into a decayed group (matrices of linear layers) and an undecayed one.

    Norm weights, biases and embedding tables are not decayed: decay there only shrinks scales
    and lookup rows without regularising a linear map (the GPT-3 / Llama recipe).

    `rules` (optim.param_groups) then take the parameters whose name they match, the first rule that
    matches winning (an order the user reads top to bottom, as in a .gitignore read backwards): each
    rule's parameters form their own groups, "rule<i>_decay" / "rule<i>_no_decay", split as above,
    with the rule's weight decay (if it sets one) and an "lr_scale" key that `build_optimizer` applies.
    A rule that matches no trainable parameter is a ConfigError naming it.
    """
    embedding_params = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)
    }
    decay, no_decay = [], []
    by_rule: list[tuple[list, list]] = [([], []) for _ in rules]
    names = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        undecayed = p.ndim < 2 or id(p) in embedding_params
        clean = param_name(name)
        names.append(clean)
        rule = next((i for i, r in enumerate(rules) if fnmatch.fnmatchcase(clean, r.match)), None)
        target = (decay, no_decay) if rule is None else by_rule[rule]
        target[undecayed].append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    for i, (rule, (rd, rn)) in enumerate(zip(rules, by_rule)):
        if not rd and not rn:
            raise ConfigError(
                f"optim.param_groups[{i}].match={rule.match!r} matches no trainable parameter (or only "
                f"ones an earlier rule took); parameter names look like: {', '.join(names[:6])}")
        for kind, params, wd in (("decay", rd, weight_decay), ("no_decay", rn, 0.0)):
            if params:
                groups.append({"params": params, "name": f"rule{i}_{kind}", "lr_scale": rule.lr_scale,
                               "weight_decay": wd if rule.weight_decay is None else rule.weight_decay})
    if rules and not decay:  # every matrix went to a rule: no empty group to carry through the run
        groups.pop(0)
    return [part for g in groups for part in _by_mesh(g)]


# What wrappers put into parameter names: DDP's leading module., torch.compile's _orig_mod., activation
# checkpointing's and FSDP1's wrapper modules; patterns are written against the model's own names.
_WRAPPER_PARTS = re.compile(
    r"(?:^module\.|(?<![^.])(?:_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.)")


def param_name(name: str) -> str:
    """`name` as the user's model has it, without the parts wrappers insert."""
    return _WRAPPER_PARTS.sub("", name)


class GroupLayout:
    """Stateful: the optimizer's param groups by name and parameter count, saved with a checkpoint and
    checked on resume. The optimizer state loads per parameter name whatever the groups, so a run
    resumed with other optim.param_groups would silently mix the saved groups' settings into the new
    ones; this refuses that instead."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        groups = optimizer.param_groups
        self.groups = [[str(g.get("name", i)), len(g["params"])] for i, g in enumerate(groups)]

    def state_dict(self) -> dict:
        return {"groups": self.groups}

    def load_state_dict(self, sd: dict) -> None:
        saved = [[str(n), int(c)] for n, c in sd["groups"]]
        if saved != self.groups:
            raise CheckpointMismatchError(
                f"the checkpoint's optimizer has param groups {saved} (name, parameters) but this run builds "
                f"{self.groups}: optim.param_groups (or which parameters train) changed since it was saved. "
                "Resume with the config the run was saved with, or start a new run (another run.dir)")


def _by_mesh(group: dict) -> list[dict]:
    """`group` split by where its tensors live: plain tensors, or DTensors of one device mesh each.
    Optimizers and clipping run foreach kernels per group, which refuse to mix a tensor with a
    DTensor or DTensors of two meshes (expert-parallel experts beside DDP / FSDP parameters). Each
    part after the first is named after its mesh's dimensions ("decay_edp_ep")."""
    parts: dict[object, list] = {}
    for p in group["params"]:
        parts.setdefault(getattr(p, "device_mesh", None), []).append(p)
    if len(parts) <= 1:
        return [group]
    out = []
    for i, (mesh, params) in enumerate(parts.items()):
        name = group["name"] if i == 0 else f"{group['name']}_{'_'.join(mesh.mesh_dim_names or ('mesh',))}"
        out.append({**group, "params": params, "name": name})
    return out


def fused_by_default(device_type: str) -> bool:
    """Whether Adam/AdamW run fused where `optim.fused` is unset: on CPU the fused kernel is several times
    faster than the for-loop path and matches it to float rounding (see shared cpu-facts)."""
    return device_type in ("cpu", "cuda")


def _fused(model: nn.Module, fused: bool | None) -> bool:
    if fused is not None:
        return fused
    return fused_by_default(next(model.parameters()).device.type)


def _adamw(model: nn.Module, groups: list[dict], cfg: AdamWConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=_fused(model, cfg.fused)
    )


def _adam(model: nn.Module, groups: list[dict], cfg: AdamConfig) -> torch.optim.Optimizer:
    return torch.optim.Adam(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=_fused(model, cfg.fused)
    )


def _sgd(model: nn.Module, groups: list[dict], cfg: SGDConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd.momentum, nesterov=cfg.sgd.nesterov)


def _lion(model: nn.Module, groups: list[dict], cfg: LionConfig) -> torch.optim.Optimizer:
    return Lion(groups, lr=cfg.lr, betas=tuple(cfg.betas))


def _adafactor(model: nn.Module, groups: list[dict], cfg: AdafactorConfig) -> torch.optim.Optimizer:
    a = cfg.adafactor
    return Adafactor(
        groups,
        lr=None if a.relative_step else cfg.lr,
        eps=tuple(a.eps),
        clip_threshold=a.clip_threshold,
        decay_rate=a.decay_rate,
        beta1=a.beta1,
        scale_parameter=a.scale_parameter,
        relative_step=a.relative_step,
        warmup_init=a.warmup_init,
    )


def _adamw8bit(model: nn.Module, groups: list[dict], cfg: AdamW8bitConfig) -> torch.optim.Optimizer:
    q = cfg.adamw8bit
    if use_bitsandbytes(q.backend, next(model.parameters()).device, q.block_size):
        return bitsandbytes_adamw8bit(groups, cfg.lr, tuple(cfg.betas), cfg.eps, q.block_size, q.min_size)
    return AdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, block_size=q.block_size,
                     min_quant_size=q.min_size)


def _sophia(model: nn.Module, groups: list[dict], cfg: SophiaConfig) -> torch.optim.Optimizer:
    s = cfg.sophia
    return Sophia(groups, lr=cfg.lr, betas=tuple(cfg.betas), rho=s.rho, eps=cfg.eps,
                  hessian_every=s.hessian_every, estimator=s.estimator)


def _sophia_capabilities(cfg: SophiaConfig) -> Capabilities:
    hutchinson = cfg.sophia.estimator == "hutchinson"
    return Capabilities(
        pipeline="optim.name=sophia estimates its Hessian with a whole-model forward, which a pipeline "
        "(parallel.pp > 1) does not have",
        data_parallel="optim.sophia.estimator=hutchinson's second backward bypasses the data-parallel "
        "gradient reduction; use optim.sophia.estimator=gnb" if hutchinson else None,
        zero1="optim.name=sophia refreshes its Hessian on the whole optimizer, which parallel.zero=1 "
        "partitions; use parallel.zero=2/3 or DDP (parallel.dp_replicate)",
        non_token_objective="optim.name=sophia samples labels from the model's next-token distribution for "
        "its Hessian estimate, which needs a token-level objective",
    )


def _muon(model: nn.Module, groups: list[dict], cfg: MuonConfig) -> torch.optim.Optimizer:
    m = cfg.muon
    return MuonAdamW(split_muon_groups(groups, hidden_matrices(model)), lr=cfg.lr, betas=tuple(cfg.betas),
                     eps=cfg.eps, muon_lr=m.lr, momentum=m.momentum, nesterov=m.nesterov, ns_steps=m.ns_steps,
                     fused=_fused(model, cfg.fused))


_MUON = Capabilities(
    sharded="optim.name=muon orthogonalises whole matrices, but parallel.dp_shard/tp shard them; use DDP "
    "(parallel.dp_replicate) or another optimizer",
    pipeline="optim.name=muon finds its matrices in model.layers, which pipeline stages (parallel.pp > 1) "
    "split; use DDP (parallel.dp_replicate) or another optimizer",
)
_ADAMW8BIT = Capabilities(
    sharded="optim.name=adamw8bit is not supported with sharded parameters (parallel.dp_shard/tp); use "
    "parallel.zero=1 or DDP (parallel.dp_replicate)",
)

SPECS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("adamw", _adamw, MEMORY["adamw"]),
    "adam": OptimizerSpec("adam", _adam, MEMORY["adam"]),
    "sgd": OptimizerSpec("sgd", _sgd, MEMORY["sgd"]),
    "lion": OptimizerSpec("lion", _lion, MEMORY["lion"]),
    "adafactor": OptimizerSpec("adafactor", _adafactor, MEMORY["adafactor"], lambda cfg: Capabilities(
        fixed_lr="optim.adafactor.relative_step=true computes its own step size and ignores the lr"
        if cfg.adafactor.relative_step else None)),
    "adamw8bit": OptimizerSpec("adamw8bit", _adamw8bit, MEMORY["adamw8bit"], lambda cfg: _ADAMW8BIT),
    "sophia": OptimizerSpec("sophia", _sophia, MEMORY["sophia"], _sophia_capabilities,
                            lambda opt: [HessianRefresh(opt)]),
    "muon": OptimizerSpec("muon", _muon, MEMORY["muon"], lambda cfg: _MUON),
}
assert SPECS.keys() == OPTIMIZER_CONFIGS.keys(), "every optimizer in the config schema has a spec"
assert all(spec.memory is MEMORY[name] for name, spec in SPECS.items()), "one memory fact per optimizer"


OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


@dataclass(frozen=True)
class UserOptimizer:
    """What `Trainer(optimizer=..., param_groups=...)` hands over: a torch optimizer built over the model's
    parameters, or a factory that lmforge calls with the param groups it would use (the no-decay split
    and optim.param_groups' rules, each group a dict with "params", "weight_decay", "name" and, for a rule,
    "lr_scale", which lmforge applies to the built optimizer's lrs); or param groups of the user's own
    (dicts of "params" and any of the optimizer's options, plus "name" and "lr_scale" if wanted; without
    "weight_decay", optim.weight_decay) for the optimizer the config names. Either must hold exactly the
    model's trainable parameters."""

    optimizer: torch.optim.Optimizer | OptimizerFactory | None = None
    param_groups: list[dict] | None = None

    @property
    def brings_optimizer(self) -> bool:
        return self.optimizer is not None


def build_optimizer(model: nn.Module, cfg: OptimConfig,
                    user: UserOptimizer | None = None) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` over `param_groups` (weight decay per group; optim.param_groups' lr
    scales multiply the groups' lrs as built, which the schedule then scales as it does every lr); or
    the user's (see `UserOptimizer`)."""
    if user is None:
        groups = param_groups(model, cfg.weight_decay, cfg.param_groups)
        optimizer = SPECS[cfg.name].build(model, groups, cfg)
    else:
        optimizer = _user_optimizer(model, cfg, user)
    for group in optimizer.param_groups:
        scale = group.pop("lr_scale", 1.0)  # not kept: checkpoints hold the optimizer's own keys only
        if scale != 1.0 and group["lr"] is None:
            raise ConfigError("optim.param_groups: lr_scale needs an lr to scale, but "
                              "optim.adafactor.relative_step=true computes its own; set relative_step=false "
                              "or leave lr_scale out")
        if scale != 1.0:
            group["lr"] *= scale
    return optimizer


def _user_optimizer(model: nn.Module, cfg: OptimConfig, user: UserOptimizer) -> torch.optim.Optimizer:
    if user.optimizer is not None and user.param_groups is not None:
        raise ConfigError("Trainer: give optimizer= or param_groups=, not both (a factory given as "
                          "optimizer= receives the param groups)")
    if user.param_groups is not None:
        # a group without a weight decay takes optim.weight_decay, not the optimizer class's default
        groups = [{"weight_decay": cfg.weight_decay, **g}
                  for g in _checked_groups(model, user.param_groups, "Trainer(param_groups=...)")]
        if cfg.param_groups:
            raise ConfigError("Trainer(param_groups=...) and optim.param_groups both say how to group the "
                              "parameters: keep one (an \"lr_scale\" key in your groups does what a rule's "
                              "does)")
        return SPECS[cfg.name].build(model, groups, cfg)
    instance = isinstance(user.optimizer, torch.optim.Optimizer)
    # optim.* keys configure lmforge's optimizer; beside the user's they would do nothing: refused
    allowed = {"name"} if instance else {"name", "weight_decay", "param_groups"}
    ignored = sorted(cfg.model_fields_set - allowed) + (["name"] if cfg.name != "adamw" else [])
    if ignored:
        raise ConfigError("Trainer(optimizer=...) brings its own optimizer, so "
                          f"optim.{', optim.'.join(ignored)} would do nothing: set them on your optimizer "
                          "and leave them out of the config")
    if instance:
        optimizer = user.optimizer
    elif callable(user.optimizer):
        optimizer = user.optimizer(param_groups(model, cfg.weight_decay, cfg.param_groups))
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"Trainer(optimizer=<factory>): the factory returned "
                              f"{type(optimizer).__name__}, not a torch.optim.Optimizer")
    else:
        raise ConfigError(f"Trainer(optimizer=...): expected a torch.optim.Optimizer or a callable taking "
                          f"the param groups, got {type(user.optimizer).__name__}")
    _checked_groups(model, optimizer.param_groups, "Trainer(optimizer=...)")
    return optimizer


def _checked_groups(model: nn.Module, groups: list[dict], what: str) -> list[dict]:
    """`groups` (dicts with "params"), named where unnamed; refused unless they hold exactly the model's
    trainable parameters (a parameter left out would silently never train)."""
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) and "params" in g
                                                        for g in groups):
        raise ConfigError(f"{what}: expected a list of dicts, each with a \"params\" list")
    groups = [{**g, "params": list(g["params"]), "name": g.get("name", f"group{i}")}
              for i, g in enumerate(groups)]
    names = {id(p): param_name(n) for n, p in model.named_parameters()}
    held = {id(p) for g in groups for p in g["params"]}
    if foreign := len(held - names.keys()):
        raise ConfigError(f"{what}: {foreign} parameter(s) are not the trained model's: build the groups "
                          "from the model you pass as model= (or give a factory: it gets the groups of the "
                          "model lmforge builds)")
    missing = [names[id(p)] for p in model.parameters() if p.requires_grad and id(p) not in held]
    if missing:
        raise ConfigError(f"{what}: trainable parameters in no group would never train: "
                          f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}; add them to a "
                          "group, or set their requires_grad=False")
    return groups


def state_bytes_per_param(optimizer: torch.optim.Optimizer) -> float:
    """Bytes of optimizer state (every tensor in `optimizer.state`, step counters included) per
    trainable parameter element. Textbook fp32 figures: sgd 0, sgd+momentum 4, adam(w) 8, lion 4,
    adafactor (factored, no beta1) well under 1."""
    n_params = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    n_bytes = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                n_bytes += v.numel() * v.element_size()
    return n_bytes / max(n_params, 1)
