"""Several LoRA / DoRA adapters over one served base model (`lmforge serve --lora NAME=PATH`, and
`/v1/load_lora_adapter` at run time): the request's `model` picks one, and rows of different adapters
(and of the base) decode in the same batch.

An adapter is read from an lmforge LoRA/DoRA run dir (or one of its checkpoint dirs) or from a PEFT
adapter dir (adapter_config.json + adapter_model.safetensors, read by finetune/peft_io.py: no
pickle), and kept as each targeted layer's A (r, in), B (out, r), scaling and, for DoRA, its
row scale m / ||W + s B A|| (a constant at inference, as LoRALinear computes it in eval mode).

How a batch uses them: the served model keeps its plain nn.Linear layers; each layer some adapter
targets gets a forward hook. The engine's `_forward` opens `AdapterSet.batch(adapter of each row)`,
which groups the rows by adapter; the hook adds, for each group, that adapter's low-rank product to
the group's rows of the layer's output. From GATHER_FROM (2) adapters in one forward the rows instead
gather their adapter's A and s B from per-layer stacks of the batch's adapters (the base's slot is
zeros) and the whole batch does two bmm's per layer. Rows of the base get nothing added, and with no
adapter in a batch the hooks return at once: the base's outputs are bit for bit those of a server
without adapters. Grouping against gathering (bench/serve_multilora.py: decode, batch 8, d_model 256,
4 layers, rank 16 on every block linear, 1 thread, 2-core CPU; tokens/s relative to no adapters):
1 adapter 0.85 grouped / 0.81 gathered, 2 adapters 0.68 / 0.75, 4: 0.54 / 0.77, 8: 0.40 / 0.74;
adapters loaded but every row on the base: 1.06 (noise: nothing is computed).

Unloading removes the name at once (new requests for it get 404); requests already running keep the
adapter object they were given and finish with it, and its memory is freed when the last one ends.
Until then it still counts against `max_adapters`, so loading and unloading cannot pile up memory.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import re
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from lmforge.errors import LmforgeError
from lmforge.finetune.lora import lora_layers


class AdapterError(LmforgeError):
    """A refused load or unload; `param` is the request field at fault (lora_name or lora_path)."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message)
        self.param = param


class LoadAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's shape): the name clients will ask for, and the adapter dir
    (relative to --adapter-root, or absolute under it)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(max_length=128)


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}")
# From this many different adapters in one forward, rows gather their adapter's A and B from a stack
# and the whole batch does two bmm's per layer; below it, rows are grouped by adapter (a pair of small
# matmuls per adapter). Measured on 2 CPU cores (bench/serve_multilora.py, the module docstring): one
# adapter is faster grouped, two or more gathered.
GATHER_FROM = 2
MAX_FILES = 10_000  # files looked at under one adapter dir while checking that it stays under the root


@dataclass
class _Delta:
    """One layer's adapter: what it adds to the layer's output y = base(x)."""

    a: torch.Tensor  # (r, in)
    b: torch.Tensor  # (out, r)
    scaling: float
    scale: torch.Tensor | None = None  # DoRA: m / ||W + s B A||_row, (out,)
    bias: torch.Tensor | None = None  # DoRA: the base's bias (its W x is y - bias)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """LoRALinear.forward's addition in eval mode (same operations, same dtypes)."""
        x = x.to(self.a.dtype)
        lora = F.linear(F.linear(x, self.a), self.b)
        if self.scale is None:
            return (lora * self.scaling).to(y.dtype)
        base_out = y if self.bias is None else y - self.bias
        return ((self.scale - 1) * base_out + self.scale * lora * self.scaling).to(y.dtype)


_LOADS = itertools.count()


@dataclass(eq=False)
class Adapter:
    """A loaded adapter: its name (the `model` clients ask for), kind, rank and layers."""

    name: str
    kind: str  # "lora" or "dora"
    rank: int
    source: str
    layers: dict[str, _Delta] = field(repr=False)
    created: int = field(default_factory=lambda: int(time.time()))
    # Unique per load in this process: the prefix cache keys blocks by it, so a name reloaded with
    # other weights never reuses the keys/values the old weights computed.
    serial: int = field(default_factory=lambda: next(_LOADS))

    def card(self, parent: str) -> dict:
        """Its entry in /v1/models (vLLM's shape: `parent` is the base model)."""
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "lmforge",
                "root": parent, "parent": parent}


def _frozen(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _deltas(model_with_adapters: nn.Module) -> dict[str, _Delta]:
    """The adapters of a model that carries LoRALinear layers, as _Delta per layer name."""
    out = {}
    with torch.no_grad():
        for name, m in lora_layers(model_with_adapters).items():
            if not isinstance(m.base, nn.Linear):
                raise LmforgeError(f"{name}: an adapter over a {type(m.base).__name__} base cannot be served")
            a, b = _frozen(m.lora_A), _frozen(m.lora_B)
            scale = bias = None
            if m.dora:
                weight = m.base.weight.to(a.dtype)
                scale = _frozen(m.lora_magnitude / m._row_norm(weight, b @ a))
                bias = None if m.base.bias is None else _frozen(m.base.bias)
            out[name] = _Delta(a, b, m.scaling, scale, bias)
    return out


class AdapterSet:
    """The adapters served over `model` (an lmforge Transformer without adapters of its own).

    max_adapters: adapters held at once (unloaded ones still used by running requests included).
    max_rank: the largest rank accepted. root: the only dir runtime loads may read from (None: no
    runtime loads, only `load(..., confined=False)` at start)."""

    def __init__(self, model: nn.Module, base_name: str, *, max_adapters: int = 8, max_rank: int = 64,
                 root: str | Path | None = None) -> None:
        if lora_layers(model):
            raise LmforgeError("the served model carries LoRA adapters of its own; serve several adapters "
                               "over a base without them: serve the base run, or `lmforge merge` this run "
                               "and serve the merged one")
        if max_adapters < 1 or max_rank < 1:
            raise LmforgeError(f"--max-adapters and --max-lora-rank must be >= 1, got {max_adapters} and "
                               f"{max_rank}")
        self.model, self.base_name = model, base_name
        self.max_adapters, self.max_rank = max_adapters, max_rank
        self.root = None if root is None else Path(root).resolve(strict=True)
        if self.root is not None and not self.root.is_dir():
            raise LmforgeError(f"--adapter-root {root} is not a directory")
        self._adapters: dict[str, Adapter] = {}
        self._gone: list[weakref.ref] = []  # unloaded adapters that running requests may still hold
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._groups: list[tuple[Adapter, torch.Tensor | None]] = []
        self._rows: torch.Tensor | None = None  # gather mode: each row's slot in the stacks (0: the base)
        self._stack_key: tuple[Adapter, ...] = ()
        self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self._lock = threading.RLock()  # held by a forward and by changes of the hooks
        self._loading = threading.Lock()  # one load at a time (each may hold a model copy in memory)
        self._linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        widths = [max(m.in_features, m.out_features) for m in self._linears.values()] or [1]
        self._max_numel = max_rank * max(widths)

    # -- lookup ----------------------------------------------------------------------------------
    def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    def names(self) -> list[str]:
        return list(self._adapters)

    def cards(self) -> list[dict]:
        return [a.card(self.base_name) for a in list(self._adapters.values())]

    def held(self) -> int:
        """Adapters in memory: the loaded ones and the unloaded ones running requests still use."""
        with self._lock:
            self._gone = [r for r in self._gone if r() is not None]
            return len(self._adapters) + len(self._gone)

    # -- load / unload ---------------------------------------------------------------------------
    def load(self, name: str, path: str | Path, *, confined: bool = True) -> Adapter:
        """Read the adapter at `path` and serve it as `name`. confined: `path` (relative to the root,
        or absolute) must lie under the root, symlinks resolved. An lmforge run is read by loading its
        whole checkpoint (a second copy of the model while it loads: its base weights are checked
        against the served ones); a PEFT dir reads only the adapter tensors."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise AdapterError(f"lora_name {name!r}: use 1 to 128 letters, digits and ._:@+- (starting "
                               "with a letter or digit)", "lora_name")
        if name == self.base_name:
            raise AdapterError(f"lora_name {name!r} is the base model's name; give the adapter another",
                               "lora_name")
        with self._loading:
            self._check_room(name)
            where = self._confine(path) if confined else Path(path)
            if not where.exists():
                raise LmforgeError(f"lora_path {path}: no such adapter dir")
            layers, kind, rank = self._read(where, str(path))
            odd = next((n for n in layers if n not in self._linears), None)
            if odd is not None:  # a quantized layer (`lmforge quantize`): DoRA needs its plain weight
                kind_of = type(self.model.get_submodule(odd)).__name__
                raise AdapterError(f"{path}: the served model's {odd} is a {kind_of}, not a plain Linear "
                                   "layer; serve adapters over an unquantized base")
            adapter = Adapter(name, kind, rank, str(path), layers)
            with self._lock:
                self._check_room(name)
                for layer in layers:
                    if layer not in self._hooks:
                        self._hooks[layer] = self._linears[layer].register_forward_hook(_Hook(self, layer))
                self._adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Stop serving `name`; requests already running finish with it."""
        with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                raise KeyError(name)
            self._gone.append(weakref.ref(adapter))
            del adapter
            self._stack_key, self._stacks = (), {}  # the stacks must not keep it alive
            if self.held() == 0:  # nothing can use the hooks any more: the base is as it was
                for handle in self._hooks.values():
                    handle.remove()
                self._hooks.clear()

    def close(self) -> None:
        """Stop serving every adapter and take the hooks off the model."""
        with self._lock:
            self._adapters.clear()
            self._gone.clear()
            self._stack_key, self._stacks = (), {}
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()

    def _check_room(self, name: str) -> None:
        if name in self._adapters:
            raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first or pick "
                               "another lora_name", "lora_name")
        if self.held() >= self.max_adapters:
            raise AdapterError(f"{self.held()} adapters are held (max_adapters={self.max_adapters}, "
                               "unloaded ones still in use by running requests included); unload one first",
                               "lora_name")

    def _confine(self, path: str | Path) -> Path:
        if self.root is None:
            raise LmforgeError("this server loads no adapters at run time (start it with --adapter-root)")
        raw = Path(path)
        where = (raw if raw.is_absolute() else self.root / raw).resolve()
        if not where.is_relative_to(self.root):
            raise LmforgeError(f"lora_path {path} lies outside the adapter root; give a dir under it")
        if where.exists():  # every file the load may open stays under the root, symlinks resolved
            for i, f in enumerate(where.rglob("*")):
                if i >= MAX_FILES:
                    raise LmforgeError(f"lora_path {path} holds more than {MAX_FILES} files")
                if not f.resolve().is_relative_to(self.root):
                    raise LmforgeError(f"lora_path {path}: {f.relative_to(where)} links outside the "
                                       "adapter root")
        return where

    def _read(self, where: Path, shown: str) -> tuple[dict[str, _Delta], str, int]:
        from lmforge.finetune.peft_io import CONFIG

        if (where / CONFIG).is_file():
            return self._read_peft(where, shown)
        return self._read_run(where, shown)

    def _skeleton(self) -> nn.Module:
        """A copy of the served model's module tree sharing its tensors: adapters are loaded into it
        with lmforge's own readers without touching the served model."""
        memo: dict[int, object] = {id(self): self}
        for t in (*self.model.parameters(), *self.model.buffers()):
            memo[id(t)] = t
        for m in self.model.modules():  # hooks (ours, anyone's) are shared, never copied
            for hook in m._forward_hooks.values():
                memo[id(hook)] = hook
        return copy.deepcopy(self.model, memo)

    def _read_peft(self, where: Path, shown: str) -> tuple[dict[str, _Delta], str, int]:
        from safetensors import safe_open

        from lmforge.finetune.peft_io import SUFFIXES, WEIGHTS, load_peft_adapter, read_adapter_config

        settings = read_adapter_config(where)
        if settings["r"] > self.max_rank:
            raise LmforgeError(f"{shown}: rank r={settings['r']} exceeds --max-lora-rank {self.max_rank}")
        file = where / WEIGHTS
        if not file.is_file():
            raise LmforgeError(f"{shown} is not a PEFT adapter directory: it has no {WEIGHTS}")
        try:  # the header only: names and shapes, before any tensor is read
            with safe_open(str(file), "pt") as f:
                shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        except Exception as e:
            raise LmforgeError(f"{shown}/{WEIGHTS} is not a readable safetensors file: {e}") from None
        if len(shapes) > 3 * max(len(self._linears), 1):
            raise LmforgeError(f"{shown}/{WEIGHTS} holds {len(shapes)} tensors, more than this model's "
                               "layers can have adapters")
        for key, shape in shapes.items():
            if not key.endswith(tuple("." + s for s in SUFFIXES.values())):
                raise LmforgeError(f"{shown}/{WEIGHTS}: tensor {key!r} is a base weight saved beside the "
                                   "adapter (PEFT's modules_to_save); the adapters served together share "
                                   "one base, so this one cannot be served: merge it and serve it alone")
            numel = 1
            for d in shape:
                numel *= d
            if numel > self._max_numel:
                raise LmforgeError(f"{shown}/{WEIGHTS}: tensor {key!r} of shape {tuple(shape)} is larger "
                                   f"than any adapter of rank <= {self.max_rank} on this model")
        skeleton = self._skeleton()
        load_peft_adapter(skeleton, where)
        return _deltas(skeleton), "dora" if settings["dora"] else "lora", settings["r"]

    def _read_run(self, where: Path, shown: str) -> tuple[dict[str, _Delta], str, int]:
        from lmforge.checkpoint.runs import is_hf_dir, run_config
        from lmforge.finetune.setup import load_finetuned

        if is_hf_dir(where):
            raise LmforgeError(f"{shown} is a whole Hugging Face model, not an adapter; give an lmforge "
                               "LoRA/DoRA run dir or a PEFT adapter dir (adapter_config.json)")
        cfg, ckpt = run_config(where)
        ft = cfg.finetune
        if ft.method not in ("lora", "dora"):
            why = ("its base is quantized to NF4, so it computes other values over the served base"
                   if ft.method == "qlora" else "it has no adapters")
            raise LmforgeError(f"{shown} was fine-tuned with finetune.method={ft.method}: {why}; serve "
                               "LoRA or DoRA runs (or merge this one and serve it alone)")
        if ft.train_tokens:
            raise LmforgeError(f"{shown} also trained token rows (finetune.train_tokens): they change the "
                               "shared embeddings; merge it and serve it alone")
        if ft.r > self.max_rank:
            raise LmforgeError(f"{shown}: rank finetune.r={ft.r} exceeds --max-lora-rank {self.max_rank}")
        trained, _ = load_finetuned(cfg, ckpt, "model", next(self.model.parameters()).device)
        served = dict(self.model.named_parameters())
        theirs = {n.replace(".base.", "."): p for n, p in trained.named_parameters()
                  if not n.rpartition(".")[2].startswith("lora_")}
        for n in sorted(set(served) ^ set(theirs)):
            where_ = "the served base" if n in served else shown
            raise LmforgeError(f"{shown} does not fit the served base: only {where_} has {n}")
        for n, p in served.items():
            if p.shape != theirs[n].shape:
                raise LmforgeError(f"{shown} does not fit the served base: {n} is {tuple(theirs[n].shape)} "
                                   f"there and {tuple(p.shape)} here")
            if not torch.equal(p, theirs[n].to(p.dtype)):
                raise LmforgeError(f"{shown} was trained on another base: its {n} differs from the served "
                                   "model's (serve the run its fine-tuning started from)")
        return _deltas(trained), ft.method, ft.r

    # -- the batch -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def batch(self, adapters: Sequence[Adapter | None]) -> Iterator[None]:
        """Within the block the model computes row i with adapters[i] (None: the base)."""
        with self._lock:
            rows: dict[int, tuple[Adapter, list[int]]] = {}
            for i, a in enumerate(adapters):
                if a is not None:
                    rows.setdefault(id(a), (a, []))[1].append(i)
            device = next(self.model.parameters()).device
            self._groups = [(a, None if len(idx) == len(adapters) else torch.tensor(idx, device=device))
                            for a, idx in rows.values()]
            if len(rows) >= GATHER_FROM:
                distinct = tuple(a for a, _ in rows.values())
                self._stack(distinct)
                slot = {id(a): i + 1 for i, a in enumerate(distinct)}
                self._rows = torch.tensor([0 if a is None else slot[id(a)] for a in adapters], device=device)
            try:
                yield
            finally:
                self._groups, self._rows = [], None

    def _stack(self, distinct: tuple[Adapter, ...]) -> None:
        """Per layer, the adapters' A (k + 1, r_max, in), s B (k + 1, out, r_max) and, if any is DoRA,
        their row scales (k + 1, out); slot 0 and the adapters without the layer are zeros (and scale 1),
        smaller ranks zero-padded. Kept while the batch holds the same adapters (decode steps)."""
        if distinct == self._stack_key:
            return
        stacks = {}
        for name in dict.fromkeys(n for a in distinct for n in a.layers):
            present = [a.layers.get(name) for a in distinct]
            first = next(d for d in present if d is not None)
            r = max(d.a.shape[0] for d in present if d is not None)
            (_, n_in), n_out = first.a.shape, first.b.shape[0]
            a_all = first.a.new_zeros(len(present) + 1, r, n_in)
            b_all = first.b.new_zeros(len(present) + 1, n_out, r)
            dora = any(d is not None and d.scale is not None for d in present)
            scale = first.b.new_ones(len(present) + 1, n_out) if dora else None
            for i, d in enumerate(present, 1):
                if d is not None:
                    a_all[i, : d.a.shape[0]] = d.a
                    b_all[i, :, : d.b.shape[1]] = d.b * d.scaling
                    if d.scale is not None:
                        scale[i] = d.scale
            stacks[name] = (a_all, b_all, scale)
        self._stack_key, self._stacks = distinct, stacks


class _Hook:
    """The forward hook of one linear layer: each group's adapter added to its rows of the output."""

    def __init__(self, owner: AdapterSet, name: str) -> None:
        self.owner, self.name = owner, name

    def __call__(self, module: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor | None:
        owner = self.owner
        groups = owner._groups
        if not groups:
            return None
        x = args[0]  # (B, T, in)
        if owner._rows is not None and x.dim() == 3:
            return self._gathered(module, x, y)
        for adapter, idx in groups:
            delta = adapter.layers.get(self.name)
            if delta is None:
                continue
            if idx is None:  # every row of the batch: no gather
                y = y + delta(x, y)
            else:
                y = y.index_add(0, idx, delta(x.index_select(0, idx), y.index_select(0, idx)))
        return y


    def _gathered(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Every row's adapter at once: its A and s B gathered from the stacks, two bmm's. The base's rows
        (and adapters without this layer) gather zeros and scale 1: y + 0, exactly y."""
        stack = self.owner._stacks.get(self.name)
        if stack is None:
            return None
        a_all, b_all, scale_all = stack
        rows = self.owner._rows
        u = torch.bmm(x.to(a_all.dtype), a_all.index_select(0, rows).transpose(1, 2))  # (B, T, r)
        lora = torch.bmm(u, b_all.index_select(0, rows).transpose(1, 2))  # (B, T, out)
        if scale_all is None:
            return y + lora.to(y.dtype)
        scale = scale_all.index_select(0, rows)[:, None, :]  # (B, 1, out)
        base_out = y if module.bias is None else y - module.bias
        return y + ((scale - 1) * base_out + scale * lora).to(y.dtype)


def parse_lora_specs(specs: Sequence[str]) -> list[tuple[str, str]]:
    """`--lora NAME=PATH` items as (name, path) pairs, names unique."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise LmforgeError(f"--lora {spec!r}: give NAME=PATH (the model name clients ask for, and a "
                               "LoRA/DoRA run dir or PEFT adapter dir)")
        if name in (n for n, _ in out):
            raise LmforgeError(f"--lora {name}= is given twice; give each adapter its own name")
        out.append((name, path))
    return out


__all__ = ["Adapter", "AdapterError", "AdapterSet", "LoadAdapterRequest", "UnloadAdapterRequest",
           "parse_lora_specs"]
