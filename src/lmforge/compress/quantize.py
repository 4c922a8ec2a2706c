"""`lmforge quantize SRC OUT`: weight-only int8 / int4 quantization of a trained or imported model,
by round-to-nearest (RTN) or GPTQ on a small calibration set, written as a new run dir that
`lmforge eval` / `generate` / `export` load like any other (config.yaml with `model.quant`, one checkpoint).

The linear layers `model.quant.targets` picks (default: every linear layer of the blocks) become
QuantLinear (lmforge.models.quant); the embeddings, norms and an output head stay in floating point,
stored in `keep_dtype` (default bfloat16, what the quantized model is compared against). The source is
read and quantized before the output dir is touched; the output is built beside it and swapped in.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import torch
from pydantic import ValidationError
from torch import nn

from lmforge.checkpoint.hf_io import TOKENIZER_FILES, write_output_dir
from lmforge.checkpoint.manager import CheckpointManager
from lmforge.checkpoint.runs import check_rebuildable, is_hf_dir, run_config, run_tokenizer_file
from lmforge.compress.gptq import Hessian, gptq_quantize
from lmforge.config.load import save_config
from lmforge.config.schema import ModelConfig, QuantConfig
from lmforge.data import Tokenizer, data_dir
from lmforge.errors import ConfigError, DataError, LmforgeError
from lmforge.finetune.setup import load_merged
from lmforge.models.quant import QuantEmbedding, QuantLinear, quant_targets, scale_dtype_of
from lmforge.utils.io import atomic_write_json

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def quantize_run(
    src: str | Path,
    out: str | Path,
    bits: int = 4,
    group_size: int | None = 128,
    symmetric: bool = True,
    method: str = "rtn",
    calib: str | Path | None = None,
    calib_samples: int = 128,
    calib_seq_len: int = 256,
    overwrite: bool = False,
    head: bool = False,
    embeddings: bool = False,
    act_order: bool = False,
    percdamp: float = 0.01,
    keep_dtype: str = "bfloat16",
    say=print,
) -> dict:
    """Quantize the model at `src` (run dir, checkpoint dir or Hugging Face dir; a LoRA run's adapters
    are merged first) into a new run dir `out`. bits 4 or 8; group_size: weights per scale along the
    inputs (None: per output channel); method rtn or gptq (calibrated on `calib`, a text file or folder,
    else the run's validation shards). Returns the report written to out/quantize.json: sizes, and the
    logit deviation from the source on a few calibration sequences."""
    out = Path(out)
    _check_args(bits, group_size, method, calib_samples, calib_seq_len, percdamp, keep_dtype)
    _check_out(out, overwrite)
    cfg, ckpt = run_config(src)
    if cfg.model.quant is not None:
        raise LmforgeError(f"{src} is already quantized (model.quant: {cfg.model.quant.bits} bits); quantize "
                           "the full-precision run it came from")
    check_rebuildable(cfg, ckpt)
    tok_path = run_tokenizer_file(cfg)
    if tok_path is None:
        raise LmforgeError(f"the tokenizer of {src} is missing; was data.dir moved?")
    tokenizer = Tokenizer.load(tok_path)
    try:
        qcfg = QuantConfig(bits=bits, group_size=group_size, symmetric=symmetric, method=method, head=head,
                           embeddings=embeddings)
        model_cfg = ModelConfig.model_validate({**cfg.model.model_dump(), "quant": qcfg.model_dump()})
    except ValidationError as e:
        raise ConfigError(f"quantize {src}: {e.errors()[0]['msg']}") from None
    model, step = load_merged(cfg, ckpt)
    model.float()
    names = quant_targets(model, qcfg.targets, qcfg.head)
    _check_shapes(model, names, bits, group_size)
    ids = _calibration_ids(cfg, tokenizer, calib, calib_samples, min(calib_seq_len, cfg.model.max_seq_len),
                           required=method == "gptq")
    reference = copy.deepcopy(model)
    names = _quantize_model(model, names, qcfg, ids, act_order, percdamp, say)
    model.cfg = model_cfg
    _round_kept(model, _DTYPES[keep_dtype])
    report = {"source": str(src), "step": step, "bits": bits, "group_size": group_size,
              "symmetric": symmetric, "method": method, "act_order": act_order, "layers": names,
              "keep_dtype": keep_dtype}
    if ids is not None:
        report["logits"] = logit_deviation(reference, model, ids[:4])
    del reference
    src_data = data_dir(cfg)
    own_data = not is_hf_dir(Path(src)) and (src_data / "tokenizer.json").is_file()
    new_cfg = _output_config(cfg, out, model_cfg, f"{cfg.run.name}-int{bits}-{method}", own_data)
    stored = model.to(_DTYPES[keep_dtype])  # QuantLinear's integer buffers keep their dtype

    def write(tmp: Path) -> None:
        if own_data:
            shutil.copytree(src_data, tmp / "data", symlinks=False)
        else:
            for name in TOKENIZER_FILES:
                if (tok_path.parent / name).is_file():
                    shutil.copy2(tok_path.parent / name, tmp / name)
        saved = CheckpointManager(tmp, keep_last=1).save(step, stored, None, {})
        save_config(new_cfg, tmp / "config.yaml")
        report.update(_sizes(reference_bytes(stored), saved / "state", names, stored))
        atomic_write_json(tmp / "quantize.json", report)

    inputs = [Path(src), ckpt, tok_path] + ([src_data] if own_data else [])
    write_output_dir(out, overwrite, inputs, write)
    say(_summary(report, out))
    return report


def _output_config(cfg, out: Path, model_cfg: ModelConfig, name: str, own_data: bool):
    """The config of the quantized run at `out`: the quantized model section, a full-weights
    fine-tune, and the data section of its own copy of the source's data dir (own_data) or, for an
    imported model, the tokenizer files beside it."""
    new_cfg = cfg.model_copy(update={
        "run": cfg.run.model_copy(update={"dir": str(out), "name": name}),
        "model": model_cfg,
        "finetune": cfg.finetune.model_copy(update={"method": "full"}),
    })
    if own_data:
        return new_cfg.model_copy(update={"data": cfg.data.model_copy(update={"dir": None})})
    # an imported model: its tokenizer files travel with it
    tokenizer_cfg = cfg.data.tokenizer.model_copy(update={"path": str(out / "tokenizer.json")})
    data = cfg.data.model_copy(update={"dir": None, "tokenizer": tokenizer_cfg})
    return new_cfg.model_copy(update={"data": data})


# -- checks ------------------------------------------------------------------------------------------
def _check_args(bits, group_size, method, calib_samples, calib_seq_len, percdamp, keep_dtype) -> None:
    if bits not in (4, 8):
        raise LmforgeError(f"--bits {bits} is not supported; valid: 4 or 8")
    if group_size is not None and group_size < 2:
        raise LmforgeError(f"--group-size {group_size} must be at least 2 (or omitted for int8 per-channel)")
    if method not in ("rtn", "gptq"):
        raise LmforgeError(f"--method {method!r} is not supported; valid: rtn, gptq")
    if calib_samples < 1 or calib_seq_len < 2:
        raise LmforgeError("--calib-samples must be >= 1 and --calib-seq-len >= 2")
    if not 0 <= percdamp < 1:
        raise LmforgeError(f"percdamp={percdamp} must lie in [0, 1)")
    if keep_dtype not in _DTYPES:
        raise LmforgeError(f"keep_dtype={keep_dtype!r}; valid: {', '.join(_DTYPES)}")


def _check_out(out: Path, overwrite: bool) -> None:
    """The cheap output checks, before minutes of quantization (write_output_dir repeats them)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise LmforgeError(f"{out} exists and is not a directory; choose another output dir")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise LmforgeError(f"{out} is not empty; choose another output dir or pass --overwrite")


def _check_shapes(model: nn.Module, names: list[str], bits: int, group_size: int | None) -> None:
    """Every layer to quantize splits into groups of group_size inputs, and an even count for int4."""
    for name in names:
        k = model.get_submodule(name).in_features
        if group_size is not None and k % group_size:
            raise LmforgeError(f"--group-size {group_size} does not divide the {k} inputs of {name}; use "
                               "a group size that divides every quantized layer's in_features (e.g. 32, 64)")
        if bits == 4 and k % 2:
            raise LmforgeError(f"int4 packs two weights per byte: {name} has an odd number of inputs ({k})")


# -- calibration -------------------------------------------------------------------------------------
def _calibration_ids(cfg, tokenizer: Tokenizer, calib, n: int, T: int, required: bool) -> torch.Tensor | None:
    """(n, T) token ids: windows spread evenly over the calibration text (`calib`) or, without it, over
    the run's validation shards. None when neither exists and calibration is not `required`."""
    if calib is not None:
        from lmforge.eval.perplexity import read_texts, token_stream

        stream = np.asarray(token_stream(tokenizer, [t for _, t in read_texts(calib)]), dtype=np.int64)
        where = str(calib)
    else:
        stream, where = _val_stream(cfg)
        if stream is None:
            if required:
                raise LmforgeError("GPTQ needs calibration text: this model has no validation shards; give "
                                   "--calib FILE_OR_DIR (text, JSONL or Parquet)")
            return None
    if len(stream) < T + 1:
        raise DataError(f"calibration data {where} holds {len(stream)} tokens; at least {T + 1} are needed "
                        "(--calib-seq-len)")
    starts = np.linspace(0, len(stream) - T, num=n).astype(np.int64)
    starts = np.unique(starts)  # a short text gives fewer distinct windows
    return torch.from_numpy(np.stack([np.asarray(stream[s:s + T], dtype=np.int64) for s in starts]))


def _val_stream(cfg) -> tuple[np.ndarray | None, str]:
    from lmforge.data.prepare import load_prepared
    from lmforge.data.shards import open_shard

    d = data_dir(cfg)
    if not (d / "meta.json").is_file():
        return None, str(d)
    try:
        shards = load_prepared(d).shards("val")
    except DataError:
        return None, str(d)
    parts = [np.asarray(open_shard(p)) for p in shards]
    parts = [p for p in parts if len(p)]
    return (np.concatenate(parts).astype(np.int64) if parts else None), f"{d} (val split)"


# -- quantizing -------------------------------------------------------------------------------------
def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, layer)


def _quantize_model(model: nn.Module, names: list[str], qcfg: QuantConfig, ids: torch.Tensor | None,
                    act_order: bool, percdamp: float, say) -> list[str]:
    """Replace the linear layers `names` by QuantLinear (GPTQ on `ids`, or round to nearest), and the
    embeddings by a QuantEmbedding when qcfg asks; returns the names of every quantized module."""
    bits, group_size, symmetric = qcfg.bits, qcfg.group_size, qcfg.symmetric
    if qcfg.method == "gptq":
        say(f"GPTQ on {ids.shape[0]} calibration sequences of {ids.shape[1]} tokens, {len(names)} layers")
        _gptq_model(model, names, qcfg, ids, act_order, percdamp)
    else:
        for name in names:
            layer = QuantLinear.from_linear(model.get_submodule(name), bits, group_size, symmetric,
                                            scale_dtype_of(qcfg.scale_dtype))
            _replace(model, name, layer)
    if qcfg.embeddings:  # round to nearest: a lookup table has no activations for GPTQ to weigh
        emb = model.tok_embeddings
        if group_size is not None and emb.embedding_dim % group_size:
            raise LmforgeError(f"--group-size {group_size} does not divide the embedding size "
                               f"{emb.embedding_dim}; use a group size that divides it")
        model.tok_embeddings = QuantEmbedding.from_embedding(emb, bits, group_size, symmetric,
                                                             scale_dtype_of(qcfg.scale_dtype))
        names = [*names, "tok_embeddings"]
    return names


class _Inputs(Exception):
    """Raised by a hook to stop the forward at the first block, carrying that block's inputs."""


@torch.no_grad()
def _gptq_model(model: nn.Module, names: list[str], qcfg: QuantConfig, ids: torch.Tensor, act_order: bool,
                percdamp: float, batch_size: int = 8) -> None:
    """GPTQ block by block: each block's linear layers see inputs computed by the blocks before it,
    already quantized (the paper's sequential scheme); layers outside the blocks (an output head) see
    the final norm's output of the quantized blocks."""
    scale_dtype = scale_dtype_of(qcfg.scale_dtype)
    group = qcfg.group_size

    def grab(_module, args, _kwargs):
        raise _Inputs(args)

    hook = model.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    xs, extra = [], None
    try:
        for i in range(0, ids.shape[0], batch_size):
            try:
                model(ids[i:i + batch_size])
            except _Inputs as e:
                xs.append(e.args[0][0])  # (B, T, d_model)
                extra = e.args[0][1:]  # rope, mask, kv: the same for every batch of T tokens
    finally:
        hook.remove()

    def quantize_group(prefix: str, run) -> None:
        chosen = [n for n in names if n.startswith(prefix)]
        if not chosen:
            return
        hessians = {n: Hessian(model.get_submodule(n).in_features) for n in chosen}
        hooks = [model.get_submodule(n).register_forward_hook(
            lambda _m, inp, _o, h=hessians[n]: h.add(inp[0])) for n in chosen]
        try:
            for x in xs:
                run(x)
        finally:
            for h in hooks:
                h.remove()
        for n in chosen:
            lin = model.get_submodule(n)
            W = lin.weight.detach()
            q, scale, zero = gptq_quantize(W, hessians[n].H, qcfg.bits, group or W.shape[1], qcfg.symmetric,
                                           scale_dtype, percdamp=percdamp, act_order=act_order)
            layer = QuantLinear(lin.in_features, lin.out_features, lin.bias is not None, qcfg.bits, group,
                                qcfg.symmetric, scale_dtype)
            layer.set_quantized(q, scale, None if zero is None else zero.to(torch.int8))
            if lin.bias is not None:
                layer.bias.copy_(lin.bias)
            _replace(model, n, layer)

    for i, block in model.layers.named_children():
        quantize_group(f"layers.{i}.", lambda x, b=block: b(x, *extra))
        xs = [block(x, *extra) for x in xs]  # the quantized block's outputs feed the next
    if "output" in names:
        quantize_group("output", lambda x: model.output(model.norm(x)))
    rest = [n for n in names if not (n.startswith("layers.") or n == "output")]
    for n in rest:  # a target outside the blocks and the head: no calibrated inputs, round to nearest
        _replace(model, n, QuantLinear.from_linear(model.get_submodule(n), qcfg.bits, group, qcfg.symmetric,
                                                   scale_dtype))


@torch.no_grad()
def _round_kept(model: nn.Module, dtype: torch.dtype) -> None:
    """Round the weights kept in floating point to the dtype they are stored in, so that the logits
    measured here are those of the model as it loads."""
    for p in model.parameters():
        p.copy_(p.to(dtype).to(p.dtype))


# -- reporting --------------------------------------------------------------------------------------
@torch.no_grad()
def logit_deviation(reference: nn.Module, model: nn.Module, ids: torch.Tensor) -> dict:
    """How far `model`'s logits lie from `reference`'s on ids (B, T): max and mean |difference|, both
    also relative to the reference logits' standard deviation, and the top-1 agreement."""
    ref = reference.eval()(ids).float()  # (B, T, V)
    got = model.eval()(ids).float()
    diff = (got - ref).abs()
    std = ref.std().item()
    return {"sequences": int(ids.shape[0]), "tokens": int(ids.numel()), "max_abs": diff.max().item(),
            "mean_abs": diff.mean().item(), "ref_std": std, "max_rel": diff.max().item() / std,
            "mean_rel": diff.mean().item() / std,
            "top1_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def reference_bytes(model: nn.Module) -> dict:
    """Bytes of `model`'s weights stored in bfloat16 (every float tensor of its state dict at 2 bytes,
    tied ones once): the baseline sizes, in total and for the quantized layers alone."""
    quant = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    layers = sum(2 * (m.in_features * m.out_features + (m.out_features if m.bias is not None else 0))
                 for m in quant.values())
    seen, rest = set(), 0
    for key, t in model.state_dict().items():
        if key.rpartition(".")[0] in quant or not t.is_floating_point() or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        rest += 2 * t.numel()
    return {"bf16_bytes": rest + layers, "bf16_layer_bytes": layers}


def _sizes(base: dict, state_dir: Path, names: list[str], model: nn.Module) -> dict:
    files = sum(f.stat().st_size for f in state_dir.rglob("*") if f.is_file())
    layer_bytes = sum(t.numel() * t.element_size() for n in names
                      for t in [*model.get_submodule(n).buffers(), *model.get_submodule(n).parameters()])
    return {**base, "file_bytes": files, "layer_bytes": layer_bytes, "ratio": base["bf16_bytes"] / files,
            "layer_ratio": base["bf16_layer_bytes"] / max(layer_bytes, 1)}


def _summary(r: dict, out: Path) -> str:
    mb = 2**20
    text = (f"quantized {len(r['layers'])} layers of {r['source']} to int{r['bits']} "
            f"({'group ' + str(r['group_size']) if r['group_size'] else 'per-channel'}, "
            f"{'symmetric' if r['symmetric'] else 'asymmetric'}, {r['method']}) -> {out}\n"
            f"  size: {r['bf16_bytes'] / mb:.2f} MiB in bf16 -> {r['file_bytes'] / mb:.2f} MiB on disk "
            f"({r['ratio']:.2f}x smaller); quantized layers {r['bf16_layer_bytes'] / mb:.2f} -> "
            f"{r['layer_bytes'] / mb:.2f} MiB ({r['layer_ratio']:.2f}x)")
    if "logits" in r:
        g = r["logits"]
        text += (f"\n  logits vs the source on {g['sequences']} calibration sequences ({g['tokens']} tokens):"
                 " "
                 f"max |diff| {g['max_abs']:.4f}, mean {g['mean_abs']:.4f} ({g['mean_rel']:.2%} of the "
                 f"logits' std {g['ref_std']:.3f}); top-1 agreement {g['top1_agree']:.2%}")
    else:
        text += "\n  (no calibration text: give --calib to measure the logits against the source)"
    return text
