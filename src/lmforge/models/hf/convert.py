"""Family-independent Hugging Face conversion: config.json <-> ModelConfig, streaming safetensors
import, and sharded, atomic safetensors export in the layout `transformers` loads.

Only config.json dicts and safetensors files are touched: `transformers` itself is never imported.
Weights are never unpickled: a directory with only `pytorch_model.bin` is refused.

Per-family knowledge (key maps, fused/transposed tensors, config keys) lives in the family modules
(`llama.py` for Llama/Mistral/Qwen2, `qwen3.py`, `granite.py`, `smollm3.py`, `moe.py`, `gpt2.py`,
`bert.py`; `variants.py` picks the dense family by its flags); each provides MODEL_TYPES, config_from_hf,
config_to_hf, model_type_for, import_names, import_tensor, hf_name and export_tensors. An imported name
is ours, or (ours, j): row j of a stacked parameter (one expert of a mixture of experts, `moe.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmforge.config.schema import ModelConfig
from lmforge.errors import LmforgeError
from lmforge.models.hf import (
    bert,
    deepseek,
    gemma,
    gpt2,
    gpt_oss,
    granite,
    llama,
    moe,
    olmo2,
    phi3,
    qwen3,
    smollm3,
    t5,
    variants,
)
from lmforge.models.hf.dropout import check_dropouts
from lmforge.models.hf.keymap import unsupported
from lmforge.models.hf.task_heads import head_config, head_of, with_head
from lmforge.utils.io import atomic_write_json, disk_error, fsync_dir, read_json_object
from lmforge.utils.tensorfile import SafetensorsFile

if TYPE_CHECKING:  # the model module (torch blocks) loads only when a model is built
    from lmforge.models.transformer import Transformer

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _families() -> dict[str, ModuleType]:
    families = (llama, gpt2, bert, moe, qwen3, granite, smollm3, phi3, deepseek, olmo2, gemma, gpt_oss, t5)
    return {t: fam for fam in families for t in fam.MODEL_TYPES}


def _family(model_type: Any) -> ModuleType:
    families = _families()
    if model_type not in families:
        raise LmforgeError(
            f"unsupported Hugging Face model_type {model_type!r}; supported: {', '.join(sorted(families))}"
        )
    return families[model_type]


# ---------------------------------------------------------------------------------------- config


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The config.json of a Hugging Face model directory, as a dict."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise LmforgeError(f"{path} is not a Hugging Face model directory: it has no config.json")
    return read_json_object(file, "a model config")


@contextlib.contextmanager
def _safetensors(file: str) -> Iterator[Any]:
    """safe_open with a damaged file (truncated, a garbage header) as one clear error."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except LmforgeError:
        raise
    except Exception as e:  # SafetensorError, OSError, and what a broken header makes the reader raise
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise LmforgeError(f"{file} is not a readable safetensors file: {reason}") from None


def hf_to_model_config(hf_cfg: dict[str, Any], *, max_seq_len: int | None = None,
                       tensor_names: set[str] | None = None) -> ModelConfig:
    """Translate a config.json dict into our ModelConfig; unsupported settings raise LmforgeError.

    max_seq_len overrides the length derived from max_position_embeddings (RoPE models have no hard
    limit in transformers; Llama 3.1's 131072 builds large RoPE tables). `tensor_names`, the names the
    weight files hold, settle what a family's config.json leaves open (T5's tie: `hf_dir_model_config`).
    """
    family = _family(hf_cfg.get("model_type"))
    if hf_cfg.get("quantization_config"):
        unsupported("quantization_config", hf_cfg["quantization_config"].get("quant_method"),
                    "unquantized weights")
    try:
        kwargs = family.config_from_hf(hf_cfg)
    except KeyError as e:
        raise LmforgeError(f"config.json has no {e.args[0]!r}, which a {hf_cfg.get('model_type')} config "
                           "needs") from None
    except (TypeError, ValueError) as e:  # a value of the wrong kind (a string for a size, ...)
        if isinstance(e, LmforgeError):
            raise
        raise LmforgeError(f"config.json has a value lmforge cannot read: {e}") from None
    kwargs.update(sequence_classifier(hf_cfg))
    if tensor_names is not None and hasattr(family, "fit_to_files"):
        kwargs = family.fit_to_files(kwargs, tensor_names)
    if max_seq_len is not None:
        if kwargs["pos_embedding"] == "learned" and max_seq_len != kwargs["max_seq_len"]:
            raise LmforgeError(
                f"max_seq_len={max_seq_len} cannot apply to a model with learned positions: its position "
                f"table has {kwargs['max_seq_len']} rows"
            )
        kwargs["max_seq_len"] = max_seq_len
    try:
        return ModelConfig(**kwargs)
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise LmforgeError(f"the Hugging Face config describes a model lmforge cannot build: {e}") from None


def hf_dir_model_config(path: str | os.PathLike, *, max_seq_len: int | None = None) -> ModelConfig:
    """The ModelConfig of a Hugging Face model dir: its config.json, read together with its weights' names."""
    hf_cfg = read_hf_config(path)
    try:
        files = weight_files(path)
    except LmforgeError:  # a config lmforge cannot build says so first, before the missing weights
        hf_to_model_config(hf_cfg, max_seq_len=max_seq_len)
        raise
    names = {n for ns in files.values() for n in ns}
    return hf_to_model_config(hf_cfg, max_seq_len=max_seq_len, tensor_names=names)


def sequence_classifier(hf_cfg: dict[str, Any]) -> dict[str, Any]:
    """The score head of a ...ForSequenceClassification checkpoint (or ...ForTokenClassification /
    ...ForQuestionAnswering: task_heads.head_config)."""
    return head_config(hf_cfg)


def model_config_to_hf(
    cfg: ModelConfig,
    *,
    model_type: str | None = None,
    dtype: torch.dtype | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
) -> dict[str, Any]:
    """The config.json dict for `cfg`: GPT-2 for learned positions, else Llama / Mistral / Qwen2
    (inferred from the bias and sliding-window flags unless `model_type` says which)."""
    family = _export_family(cfg, model_type)
    model_type = family.model_type_for(cfg, model_type)
    out = family.config_to_hf(cfg, model_type)
    dtype_name = str(dtype or torch.float32).removeprefix("torch.")
    out.update(
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        # a family that derives maths from the pad id (RoBERTa's positions) set it already
        pad_token_id=pad_token_id if pad_token_id is not None else out.get("pad_token_id"),
        dtype=dtype_name,  # transformers 5
        torch_dtype=dtype_name,  # transformers 4
        use_cache=True,
    )
    return out


def export_model_type(cfg: ModelConfig, model_type: str | None = None) -> str:
    """The Hugging Face model_type `cfg` exports as (`model_type` checked if given); LmforgeError
    naming what the family cannot write otherwise."""
    return _export_family(cfg, model_type).model_type_for(cfg, model_type)


def _export_family(cfg: ModelConfig, model_type: str | None) -> ModuleType:
    if cfg.block_position_embedding:  # no Hugging Face family adds a second position table
        raise LmforgeError("this model has GLM's block position embedding (model.block_position_embedding, "
                           "objective glm), which no Hugging Face family can represent: it cannot be "
                           "exported")
    family = _export_family_of(cfg, model_type)
    if (family is t5) != (cfg.arch == "t5"):  # the encoder-decoder exports as T5, and only it does
        t5.model_type_for(cfg, model_type or family.MODEL_TYPES[0])
    if family is not gpt_oss and (only := gpt_oss.foreign_features(cfg)):
        name = model_type or family.MODEL_TYPES[0]
        raise LmforgeError(f"this model cannot be exported as Hugging Face {name!r}: {', '.join(only)} (only "
                           "gpt_oss has them)")
    return with_head(family, cfg, model_type)  # a tagger's or reader's head: its names


def _export_family_of(cfg: ModelConfig, model_type: str | None) -> ModuleType:
    model_type = model_type or cfg.hf_model_type
    if model_type is not None:
        return _family(model_type)
    if cfg.arch == "t5":  # the one encoder-decoder family
        return t5
    if cfg.mla is not None:
        return deepseek
    if gpt_oss.foreign_features(cfg):
        return gpt_oss
    for fam in (olmo2, gemma):  # families recognised by block features of their own
        if fam.claims(cfg):
            return fam
    if cfg.moe is not None:
        return moe
    if cfg.arch == "encoder":
        return bert
    if (variant := variants.dense_model_type(cfg)) is not None:  # Qwen3, Granite, SmolLM3: by their flags
        return _family(variant)
    if phi3.is_default_for(cfg):
        return phi3
    # GPT-2 is the one supported decoder family with learned positions; everything else is RoPE.
    return _family("gpt2" if cfg.pos_embedding == "learned" else "llama")


# -------------------------------------------------------------------------------- reading weights


def weight_files(path: str | os.PathLike) -> dict[str, list[str]]:
    """{safetensors file: [tensor names]} of a model dir (single file or sharded index)."""
    root = Path(path)
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise LmforgeError(f"{index} is not a valid safetensors index: {e!r}") from None
        files: dict[str, list[str]] = {}
        if not isinstance(weight_map, dict):
            raise LmforgeError(f"{index}: weight_map must map tensor names to shard files")
        for name, file in weight_map.items():
            shard = root / str(file)
            if shard.resolve().parent != root.resolve():  # "../x" or an absolute path: outside the model dir
                raise LmforgeError(f"{index} lists shard {file!r}, which is not a file of {root}")
            files.setdefault(str(shard), []).append(name)
        absent = [f for f in files if not Path(f).is_file()]
        if absent:
            raise LmforgeError(f"{index} lists shard files that do not exist: {', '.join(absent)}")
        return files
    single = root / SINGLE
    if single.is_file():
        with _safetensors(str(single)) as f:
            return {str(single): list(f.keys())}
    if any((root / n).exists() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        raise LmforgeError(
            f"{path} holds only pickled PyTorch weights (pytorch_model.bin); lmforge loads safetensors "
            "only, since unpickling can run arbitrary code. Convert it once with transformers: "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir)"
        )
    raise LmforgeError(f"{path} has no weights: expected {SINGLE} or {INDEX}")


def iter_hf_tensors(files: dict[str, list[str]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time, each read into its own buffer (not memory-mapped: a mapped shard's
    pages would stay resident until it closes; see utils/tensorfile.py)."""
    for file, names in files.items():
        with SafetensorsFile(file) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise LmforgeError(f"{file} does not hold tensor {name!r} that its index lists")
                yield name, f.read(name)


def _stream_into(model: Transformer, path: str | os.PathLike,
                 place: Callable[[str, torch.Tensor, int | None], None]):
    """Check names, then feed every HF tensor of `path`, renamed and reshaped, to place(ours, tensor,
    row), row None for a whole parameter, else the row of a stacked parameter the tensor fills."""
    cfg = model.cfg
    hf_cfg = read_hf_config(path)
    model_type = hf_cfg.get("model_type")
    # a tagger's or reader's checkpoint: its names (the head's and, for some readers, the backbone's)
    family = with_head(_family(model_type), cfg, model_type, reads=head_of(hf_cfg))
    files = weight_files(path)
    # Parameters and persistent buffers (a router's balancing bias): everything a checkpoint holds.
    shapes = {n: tuple(p.shape) for n, p in model.state_dict(keep_vars=True).items()}
    filled: set = set()
    unexpected = []
    for names in files.values():
        for name in names:
            ours = family.import_names(name, cfg)
            if ours is None or any(not _fits(o, shapes) for o in ours):
                unexpected.append(name)
            filled.update(ours or [])

    def complete(n: str) -> bool:
        rows = shapes[n][0] if shapes[n] else 0
        return n in filled or (rows > 0 and all((n, j) in filled for j in range(rows)))

    # A buffer the file lacks (a routing bias a checkpoint without bias balancing has not) keeps its init.
    params = {n for n, _ in model.named_parameters()}
    missing = [f"{family.hf_name(n, cfg)} (our {n})" for n in shapes if n in params and not complete(n)]
    if missing or unexpected:
        parts = [f"missing tensors: {', '.join(missing)}"] if missing else []
        parts += [f"unexpected tensors: {', '.join(unexpected)}"] if unexpected else []
        raise LmforgeError(f"the weights in {path} do not match its config.json: " + "; ".join(parts))
    for name, tensor in iter_hf_tensors(files):
        for key, t in family.import_tensor(name, tensor, cfg):
            ours, row = _split(key)
            want = shapes[ours] if row is None else shapes[ours][1:]
            if tuple(t.shape) != want:
                where = ours if row is None else f"{ours}[{row}]"
                raise LmforgeError(
                    f"tensor {name} in {path} has shape {tuple(tensor.shape)}, which does not fit our "
                    f"{where} of shape {want}"
                )
            place(ours, t, row)


def _split(key: str | tuple[str, int]) -> tuple[str, int | None]:
    """(parameter name, row or None) of an imported name."""
    return (key, None) if isinstance(key, str) else (key[0], int(key[1]))


def _fits(key: str | tuple[str, int], shapes: dict[str, tuple[int, ...]]) -> bool:
    """The imported name is one of our parameters (and, for a row, one within its first dimension)."""
    name, row = _split(key)
    return name in shapes and (row is None or (len(shapes[name]) > 1 and 0 <= row < shapes[name][0]))


def from_hf(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    max_seq_len: int | None = None,
) -> Transformer:
    """Build our model from a Hugging Face dir (config.json + safetensors, single or sharded).

    The model is built on the meta device and each parameter is materialised once, from its tensor in
    the file (memory: the model plus one tensor); then the RoPE tables are computed.
    """
    from lmforge.models.transformer import build_model

    cfg = hf_dir_model_config(path, max_seq_len=max_seq_len)
    model = build_model(cfg, device="meta")  # the Transformer, or the Encoder for BERT / RoBERTa
    device = torch.device(device)
    used: set[int] = set()

    def place(ours: str, t: torch.Tensor, row: int | None) -> None:
        module_name, _, attr = ours.rpartition(".")
        module = model.get_submodule(module_name)
        if attr in module._buffers:  # a persistent buffer keeps its own dtype (float32 routing bias)
            buf = module._buffers[attr]
            module._buffers[attr] = torch.empty(t.shape, dtype=buf.dtype, device=device).copy_(t)
            return
        if row is not None:  # one expert of a stacked parameter: materialised whole at its first row
            if getattr(module, attr).is_meta:
                shape = getattr(module, attr).shape
                setattr(module, attr, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))
            with torch.no_grad():
                getattr(module, attr)[row].copy_(t)
            return
        # A tensor read whole (its own buffer: utils/tensorfile.py) already in the target dtype and
        # device becomes the parameter as it is; anything else (GPT-2's split c_attn gives strided
        # views, a cast, another device, a buffer already given away) is copied exactly once. No
        # second buffer per weight: a freed read buffer between long-lived weights fragments the heap.
        own = (t.dtype == dtype and t.device == device and t._base is None and t.is_contiguous()
               and t.untyped_storage().nbytes() == t.numel() * t.element_size()
               and t.untyped_storage().data_ptr() not in used)
        value = t if own else torch.empty(t.shape, dtype=dtype, device=device).copy_(t)
        used.add(value.untyped_storage().data_ptr())
        setattr(module, attr, nn.Parameter(value))

    _stream_into(model, path, place)
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_meta:  # RoPE tables (filled below), a routing bias the file lacks (starts at 0)
                setattr(module, name, torch.zeros(buf.shape, dtype=buf.dtype, device=device))
    model.init_buffers()
    return model


_NOT_ARCHITECTURE = {"preset", "n_kv_heads", "head_dim", "d_ff", "max_seq_len", "score_head", "value_head",
                     "num_labels", "score_reads", "dropout", "attention_dropout", "hidden_dropout",
                     "init_std", "init", "init_from", "quant", "moe", "rope_scaling"}


def load_pretrained(path: str | os.PathLike, model: Transformer) -> None:
    """Load the weights of a Hugging Face dir into an existing, materialised model (for
    `model.init_from`), after checking that its config.json describes the same architecture.

    The model keeps its dtype and device; max_seq_len may differ for RoPE models (not for learned
    positions, whose table is a weight).
    """
    ours = model.cfg
    theirs = hf_dir_model_config(path)
    # Every architecture field, so that a block flag added later is compared too; not compared: what
    # the run may choose itself (heads added on top, dropout, init, length, quantization) and what has
    # its own signature below (moe, rope_scaling) or its resolved form (kv heads, head dim, d_ff).
    fields = [f for f in type(ours).model_fields if f not in _NOT_ARCHITECTURE]
    fields += ["resolved_kv_heads", "resolved_head_dim", "resolved_d_ff"]
    if ours.pos_embedding == "learned":
        fields.append("max_seq_len")  # the position table is a weight
    diffs = [
        f"{f.removeprefix('resolved_')}: model {getattr(ours, f)!r}, {path} {getattr(theirs, f)!r}"
        for f in fields
        if getattr(ours, f) != getattr(theirs, f)
    ]
    if _moe_signature(ours) != _moe_signature(theirs):
        diffs.append(f"moe: model {_moe_signature(ours)}, {path} {_moe_signature(theirs)}")
    if _rope_signature(ours) != _rope_signature(theirs):
        diffs.append(f"rope_scaling: model {_rope_signature(ours)}, {path} {_rope_signature(theirs)}")
    if diffs:
        raise LmforgeError(
            f"model.init_from={path} does not match the model section; set these to the checkpoint's "
            "values: " + "; ".join(diffs)
        )
    params = dict(model.state_dict(keep_vars=True))

    def place(name: str, t: torch.Tensor, row: int | None) -> None:
        with torch.no_grad():
            (params[name] if row is None else params[name][row]).copy_(t)

    _stream_into(model, path, place)


def _moe_signature(cfg: ModelConfig) -> dict[str, Any] | None:
    """The mixture-of-experts fields that shape the weights or the routing; the training settings
    (aux/z-loss weights, capacity, bias balancing) may differ from the checkpoint's."""
    m = cfg.moe
    if m is None:
        return None
    from lmforge.models.moe import expert_d_ff, shared_d_ff

    return dict(n_experts=m.n_experts, top_k=m.top_k, d_ff_expert=expert_d_ff(cfg),
                shared_d_ff=shared_d_ff(cfg), shared_gate=m.shared_gate, router_score=m.router_score,
                norm_topk_prob=m.norm_topk_prob, n_group=m.n_group, topk_group=m.topk_group,
                routed_scaling=m.routed_scaling, dense_layers=m.dense_layers, router_bias=m.router_bias,
                experts_bias=m.experts_bias, expert_act=m.expert_act, swiglu_alpha=m.swiglu_alpha,
                swiglu_limit=m.swiglu_limit)


def _rope_signature(cfg: ModelConfig) -> dict[str, Any] | None:
    """The RoPE scaling fields that change the maths, with the original length resolved."""
    sc = cfg.rope_scaling
    if sc is None:
        return None
    out: dict[str, Any] = {"type": sc.type, "factor": sc.factor}
    if sc.type != "linear":
        out["original_max_position_embeddings"] = sc.original_max_position_embeddings or cfg.max_seq_len
    if sc.type == "llama3":
        out.update(low_freq_factor=sc.low_freq_factor, high_freq_factor=sc.high_freq_factor)
    if sc.type in ("yarn", "longrope"):
        keys = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate", "attention_factor")
        keys = keys if sc.type == "yarn" else ("short_factor", "long_factor", "attention_factor")
        out.update({k: getattr(sc, k) for k in keys})
    return out


# -------------------------------------------------------------------------------- writing weights


def _write_safetensors(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write a safetensors file under a temporary name, then rename it into place."""
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".tmp", dir=file.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})  # transformers requires format=pt
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise disk_error(e, str(file)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def to_hf(
    model: Transformer,
    path: str | os.PathLike,
    *,
    max_shard_size: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    model_type: str | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
) -> list[Path]:
    """Write `model` as a Hugging Face dir that `AutoModelForCausalLM.from_pretrained` loads.

    Writes config.json, generation_config.json (when a bos/eos/pad id is given), and model.safetensors,
    or `model-0000i-of-0000N.safetensors` shards of at most max_shard_size bytes (a larger tensor gets
    a shard of its own) plus model.safetensors.index.json. Every file is written atomically; weight
    files of an earlier export in the same dir that this one does not use are removed afterwards.
    Tensors are written contiguous, in `dtype` (default: as they are), tied weights once.
    Returns the written files.
    """
    cfg = model.cfg
    family = _export_family(cfg, model_type)
    model_type = family.model_type_for(cfg, model_type)
    check_dropouts(cfg, family.config_to_hf(cfg, model_type), model_type)  # before anything is written
    state = {k: v.detach() for k, v in model.state_dict().items()}
    out_dtype = dtype or next(iter(state.values())).dtype

    # Plan the shards from sizes first: the shard count is part of every shard's file name.
    shards: list[list[str]] = [[]]
    sizes: dict[str, int] = {}
    current = 0  # bytes in the last shard
    for name, t in family.export_tensors(state, cfg):
        sizes[name] = t.numel() * out_dtype.itemsize
        if shards[-1] and current + sizes[name] > max_shard_size:
            shards.append([])
            current = 0
        shards[-1].append(name)
        current += sizes[name]
    n = len(shards)
    file_of = {name: SINGLE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
               for k, names in enumerate(shards) for name in names}

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    tensors = family.export_tensors(state, cfg)
    for names in shards:
        shard = {}
        for name in names:
            got, t = next(tensors)
            assert got == name, (got, name)
            shard[name] = t.to(device="cpu", dtype=out_dtype).contiguous()
        file = root / file_of[names[0]]
        _write_safetensors(file, shard)
        written.append(file)
        del shard
    if n > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": file_of}
        atomic_write_json(root / INDEX, index)
        written.append(root / INDEX)
    hf_cfg = model_config_to_hf(cfg, model_type=model_type, dtype=out_dtype, bos_token_id=bos_token_id,
                                eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    atomic_write_json(root / "config.json", hf_cfg)
    written.append(root / "config.json")
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    if any(v is not None for v in ids.values()):
        gen = {k: v for k, v in ids.items() if v is not None}
        atomic_write_json(root / "generation_config.json", {**gen, "_from_model_config": True})
        written.append(root / "generation_config.json")
    for stale in root.iterdir():
        is_weights = stale.name in (SINGLE, INDEX) or _SHARD.fullmatch(stale.name)
        if is_weights and stale not in written:
            stale.unlink()
    fsync_dir(root)
    return written
