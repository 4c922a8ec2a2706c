"""`lmforge prune SRC OUT`: a trained run pruned, optionally fine-tuned a little to recover, and
written as a new run dir that `lmforge eval`, `lmforge generate` and `model.init_from` take like any
other, with a report of the sparsity (counted from the weights), the parameter counts and the
validation loss before pruning, after it and after the recovery.

Methods (`PruneSpec.method`):
  magnitude  unstructured: the lowest-scoring `sparsity` fraction of the blocks' linear weights is
             zeroed, per weight matrix (scope "layer") or ranked over all of them (scope "global").
  2:4        semi-structured: 2 of every 4 consecutive weights along the input dimension zeroed.
  heads      whole attention heads (kv groups with GQA) removed: a smaller dense model.
  channels   MLP hidden channels removed: a smaller dense model.
Scores (`score`): weight magnitude, or Wanda's |W| * ||X|| with activations of calibration text (a
file, or the run's own training split). The recovery (`recover_steps`) continues the source's
causal-LM training on the pruned model from its config with recovery defaults (peak lr a tenth of the
source's, 10% warm-up, no weight averages, no mid-run evaluation), then a recovery config (-c) and
--set items on top; unstructured zeros stay exactly zero through it (compress/sparsity.py: KeepSparsity).
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from lmforge.assembly import build_run
from lmforge.checkpoint.hf_io import write_output_dir
from lmforge.checkpoint.manager import CheckpointManager
from lmforge.checkpoint.runs import check_rebuildable, is_hf_dir, run_config
from lmforge.compress.sparsity import (
    KeepSparsity,
    apply_masks,
    input_norms,
    prunable_weights,
    scores_of,
    semi_structured_masks,
    sparsity_stats,
    unstructured_masks,
)
from lmforge.compress.structured import channel_scores, group_size, head_scores, keep_highest, shrink
from lmforge.config.load import config_from_dict, config_to_dict, save_config
from lmforge.config.methods import DEFAULT_METHOD
from lmforge.config.schema import Config, ModelConfig
from lmforge.data import TokenLoader, data_dir
from lmforge.engine.evaluate import evaluate_loss
from lmforge.errors import ConfigError, LmforgeError
from lmforge.eval.perplexity import read_texts, token_stream
from lmforge.utils.io import atomic_write_json
from lmforge.utils.safe_yaml import load_yaml, read_yaml_text

METHODS = ("magnitude", "2:4", "heads", "channels")
SCORES = ("magnitude", "wanda")
SCOPES = ("layer", "global")
REPORT = "prune_report.json"


@dataclass(frozen=True)
class PruneSpec:
    """What to prune and how; see the module docstring. Structured methods take a count (`heads`:
    query heads removed per layer; `channels`: MLP channels removed per layer) or a `ratio` of them."""

    method: str
    sparsity: float | None = None
    scope: str = "layer"
    heads: int | None = None
    channels: int | None = None
    ratio: float | None = None
    score: str = "magnitude"
    calib: str | None = None
    calib_seqs: int = 64
    include_head: bool = False


def units_to_remove(spec: PruneSpec, cfg: ModelConfig) -> int:
    """Check `spec` against the model it is for; returns the kv groups (heads) or channels removed per
    layer (0 for unstructured methods). LmforgeError naming the option and what would be right."""
    if spec.method not in METHODS:
        raise LmforgeError(f"--method {spec.method!r}: valid methods are {', '.join(METHODS)}")
    if cfg.quant is not None:  # its block weights are integers and scales: nothing to zero, nothing to cut
        raise LmforgeError(f"the model is quantized (model.quant: int{cfg.quant.bits}, written by lmforge "
                           "quantize): pruning zeroes or removes full-precision weights, which it does not "
                           "have; prune the run it was quantized from, then quantize the pruned run")
    if cfg.moe is not None and spec.method == "channels":
        raise LmforgeError("--method channels removes channels of each block's MLP, and this model's blocks "
                           "have mixture-of-experts layers (model.moe) instead; use --method heads, "
                           "magnitude or 2:4")
    if cfg.mla is not None and spec.method == "heads":
        raise LmforgeError("--method heads removes query/key/value heads of grouped-query attention, and "
                           "this model's blocks have multi-head latent attention (model.mla), whose heads "
                           "share a compressed latent; use --method magnitude or 2:4")
    if spec.score not in SCORES:
        raise LmforgeError(f"--score {spec.score!r}: valid scores are {', '.join(SCORES)}")
    if spec.scope not in SCOPES:
        raise LmforgeError(f"--scope {spec.scope!r}: valid scopes are {', '.join(SCOPES)}")
    if spec.calib is not None and spec.score != "wanda":
        raise LmforgeError("--calib gives the activations of --score wanda; add --score wanda or drop "
                           "--calib")
    if spec.calib_seqs < 1:
        raise LmforgeError(f"calib_seqs must be at least 1, got {spec.calib_seqs}")
    given = {k for k in ("sparsity", "heads", "channels", "ratio") if getattr(spec, k) is not None}
    wanted = {"magnitude": {"sparsity"}, "2:4": set(), "heads": {"heads", "ratio"},
              "channels": {"channels", "ratio"}}[spec.method]
    extra = sorted(given - wanted)
    if extra:
        takes = f"; it takes {' or '.join('--' + w for w in sorted(wanted))}" if wanted else ""
        raise LmforgeError(f"--{extra[0]} does not go with --method {spec.method}{takes}")
    if spec.method == "magnitude":
        if spec.sparsity is None or not 0.0 < spec.sparsity < 1.0:  # 0 would "succeed" and prune nothing
            raise LmforgeError(f"--method magnitude needs --sparsity in (0, 1) (the fraction of weights "
                               f"zeroed), got {spec.sparsity}")
        return 0
    if spec.include_head and spec.method in ("heads", "channels"):
        raise LmforgeError("--include-head goes with the unstructured methods (magnitude, 2:4) only")
    if spec.method == "2:4":
        return 0
    if (spec.ratio is None) == (getattr(spec, spec.method) is None):
        raise LmforgeError(f"--method {spec.method} needs either --{spec.method} N (removed per layer) or "
                           "--ratio R (the fraction removed), not both")
    if spec.ratio is not None and not 0.0 < spec.ratio < 1.0:
        raise LmforgeError(f"--ratio must lie in (0, 1), got {spec.ratio}")
    if spec.method == "channels":
        ff = cfg.resolved_d_ff
        n = spec.channels if spec.ratio is None else round(spec.ratio * ff)
        if not 0 < n < ff:
            rounded = f" (--ratio {spec.ratio} rounds to {n})" if spec.ratio else ""
            raise LmforgeError(f"--channels {n}: the model has {ff} MLP channels per layer; remove between 1 "
                               f"and {ff - 1}{rounded}")
        return n
    h, hkv, g = cfg.n_heads, cfg.resolved_kv_heads, group_size(cfg)
    if spec.ratio is not None:
        groups = round(spec.ratio * hkv)
        if not 0 < groups < hkv:
            raise LmforgeError(f"--ratio {spec.ratio} of {hkv} kv groups ({h} heads) rounds to {groups} "
                               f"groups; choose a ratio that removes between 1 and {hkv - 1} of them")
        return groups
    n = spec.heads
    where = f"the model has {h} query heads" + (f" in {hkv} kv groups of {g}" if g > 1 else "")
    if not 0 < n < h:
        raise LmforgeError(f"--heads {n}: {where}; remove between 1 and {h - 1}")
    if n % g:
        raise LmforgeError(f"--heads {n}: {where}, and with grouped-query attention whole groups are "
                           f"removed: give a multiple of {g} below {h}")
    return n // g


def calibration_batches(tokenizer, seq_len: int, n_seqs: int, path: str | Path | None = None,
                        data=None, batch_size: int = 8) -> list[torch.Tensor]:
    """Up to `n_seqs` windows of `seq_len` token ids as (B, T) batches: from the text at `path` (a
    .txt/.md/.jsonl/.parquet file or a folder; lmforge eval data --data reads the same), else from the
    start of the prepared data's train split."""
    if path is not None:
        ids = torch.tensor(token_stream(tokenizer, [t for _, t in read_texts(path)]), dtype=torch.long)
        n = min(n_seqs, len(ids) // seq_len)
        if n == 0:
            raise LmforgeError(f"--calib {path}: {len(ids)} tokens, fewer than one window of {seq_len}; give "
                               "more calibration text")
        windows = ids[: n * seq_len].view(n, seq_len)  # (n, T)
        return list(windows.split(batch_size))
    loader = TokenLoader(data.shards("train"), seq_len, batch_size, shuffle=False, drop_last=False)
    batches = [b.input_ids for b in loader.iter_eval_batches(-(-n_seqs // batch_size))]
    return list(torch.cat(batches)[:n_seqs].split(batch_size)) if batches else []


# A mixture of experts' weights ((n_experts, out, in) stacks and the router): unstructured pruning does not
# reach them, and says so (the report's not_pruned) rather than letting "sparsity of the pruned weights"
# read as the model's.
_EXPERT_WEIGHT = re.compile(r"(?:^|\.)layers\.\d+\.moe\.")


def _check_reachable(model: nn.Module) -> None:
    """Refuse a model whose block weights pruning cannot touch: quantized layers (lmforge quantize's int
    weights, QLoRA's NF4 base) hold integers and scales, not the parameters masks zero."""
    from lmforge.finetune.nf4 import NF4Linear
    from lmforge.models.quant import QuantLinear

    kinds = {type(m).__name__ for m in model.modules() if isinstance(m, (QuantLinear, NF4Linear))}
    if kinds:
        raise LmforgeError(f"the model's layers are quantized ({', '.join(sorted(kinds))}): pruning zeroes "
                           "or removes full-precision weights, which they do not have; prune the "
                           "full-precision model, then quantize the pruned one")


def prune_model(model: nn.Module, spec: PruneSpec, calib: list[torch.Tensor] | None = None
                ) -> tuple[nn.Module, dict[str, Any]]:
    """Prune lmforge's Transformer `model` as `spec` says. Unstructured methods zero weights in place
    and return `model`; structured ones return a new, smaller model (`model` is left as it was).
    `calib`: (B, T) token batches, needed by the wanda score. Returns (model, details)."""
    removed = units_to_remove(spec, model.cfg)
    norms, details = None, {}
    if spec.score == "wanda":
        if not calib:
            raise LmforgeError("--score wanda needs calibration tokens (--calib FILE, or the run's train "
                               "split)")
        names = {"heads": [f"layers.{i}.attn.wo.weight" for i in range(model.cfg.n_layers)],
                 "channels": [f"layers.{i}.mlp.w_down.weight" for i in range(model.cfg.n_layers)]}.get(
            spec.method, list(prunable_weights(model, spec.include_head)))
        norms = input_norms(model, calib, names)
        details["calib_tokens"] = sum(b.numel() for b in calib)
    _check_reachable(model)
    if spec.method in ("magnitude", "2:4"):
        weights = prunable_weights(model, spec.include_head)
        unreached = sum(p.numel() for n, p in model.named_parameters() if _EXPERT_WEIGHT.search(n))
        if unreached:
            details["not_pruned"] = {"moe_expert_params": unreached}
        scores = scores_of(weights, norms)
        masks = (unstructured_masks(scores, spec.sparsity, spec.scope) if spec.method == "magnitude"
                 else semi_structured_masks(scores))
        apply_masks(weights, masks)
        return model, details
    if spec.method == "heads":
        keep = keep_highest(head_scores(model, norms), removed)
        details.update(kv_groups_removed=removed, heads_removed=removed * group_size(model.cfg),
                       kept_kv_groups=[k.tolist() for k in keep])
        return shrink(model, kv_groups=keep), details
    keep = keep_highest(channel_scores(model, norms), removed)
    details.update(channels_removed=removed)
    return shrink(model, channels=keep), details


# -- the run-level command ---------------------------------------------------------------------------
def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _recovery_dict(cfg: Config, steps: int, recovery_config: str | Path | None) -> dict:
    """The source's config as raw data with the recovery's defaults and the recovery YAML on top."""
    raw = config_to_dict(cfg)
    sched = {"warmup_steps": steps // 10} if cfg.schedule.unit == "steps" else {}
    # A tenth of the source's peak lr (where its cosine ended with the default min_lr_ratio): the source's
    # peak, with the optimizer's moments started afresh, undid more than it recovered (bench/prune.py).
    defaults = {
        "optim": {"lr": cfg.optim.lr * 0.1},
        "train": {"max_steps": steps, "eval_every": 0, "activation_checkpointing": "none"},
        "schedule": sched,
        "averaging": {"ema": False, "swa": False},
    }
    raw = _merge(raw, defaults)
    if recovery_config is not None:
        path = Path(recovery_config)
        try:
            user = load_yaml(read_yaml_text(path, ConfigError), f"-c {path}", error=ConfigError) or {}
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"-c {path}: cannot read it ({e.strerror or e})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"-c {path}: not valid YAML: {e}") from None
        if not isinstance(user, dict):
            raise ConfigError(f"-c {path}: a recovery config is a mapping of sections (train:, optim:, ...)")
        for section in ("model", "run", "objective"):
            if section in user:
                raise ConfigError(f"{path}: {section}: the recovery's {section} section comes from the "
                                  "pruned model and the output dir; remove it")
        raw = _merge(raw, user)
    return raw


def _recovery_config(raw: dict, overrides: list[str] | tuple[str, ...], source: str, run_dir: Path,
                     model_cfg: ModelConfig, name: str) -> Config:
    for item in overrides:
        if item.split("=", 1)[0].strip().split(".")[0] in ("model", "run", "objective"):
            raise ConfigError(f"--set {item}: the recovery's model, run and objective come from the pruned "
                              "model and the output dir")
    raw = _merge(raw, {"model": {**model_cfg.model_dump(mode="json"), "init_from": None},
                       "run": {"dir": str(run_dir), "name": name, "overwrite": False}})
    return config_from_dict(raw, overrides, source=source)


def _eval(run, model: nn.Module, max_batches: int | None = None) -> dict[str, float]:
    """Validation loss of `model` on the source run's evaluation batches (what lmforge eval loss measures;
    `max_batches` caps them)."""
    batches = run.eval_batches if max_batches is None else max_batches
    out = evaluate_loss(model, run.val_loader.iter_eval_batches(batches), run.objective,
                        precision=run.precision, token_bytes=run.token_bytes, device=run.device)
    return {k: out[k] for k in ("loss", "ppl", "bpb", "tokens") if k in out}


def _params(model: nn.Module) -> dict[str, int]:
    return {"total": sum(p.numel() for p in model.parameters()),
            "nonzero": sum(int((p != 0).sum()) for p in model.parameters())}


def prune_run(
    src: str | Path,
    out: str | Path,
    spec: PruneSpec,
    *,
    recover_steps: int = 0,
    recovery_config: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    overwrite: bool = False,
    weights: str = "model",
    eval_batches: int | None = None,
    say=print,
) -> dict[str, Any]:
    """Prune the run (or checkpoint) at `src` into a new run dir `out`; returns the report that is also
    written to out/prune_report.json. The output is built beside `out` and swapped in at the end.
    `eval_batches` caps the evaluation batches (default: the source's eval section, as lmforge eval)."""
    src, out = Path(src), Path(out)
    if is_hf_dir(src):
        raise LmforgeError(f"{src} is a Hugging Face model dir: import it (lmforge import) and prepare data "
                           "for it first; pruning measures and recovers on a run's prepared data")
    cfg, ckpt = run_config(src)
    check_rebuildable(cfg, ckpt)
    if cfg.objective.name != DEFAULT_METHOD or cfg.finetune.method != "full":
        raise LmforgeError(f"{src} was trained with objective {cfg.objective.name} and finetune.method "
                           f"{cfg.finetune.method}; lmforge prune takes a pretrained ({DEFAULT_METHOD}) run "
                           "with its weights whole (fold adapters in first: lmforge merge)")
    removed = units_to_remove(spec, cfg.model)
    if recover_steps < 0:
        raise LmforgeError(f"--recover-steps must be 0 or more, got {recover_steps}")
    if recovery_config is not None or overrides:
        if not recover_steps:
            raise LmforgeError("-c and --set configure the recovery fine-tune: give --recover-steps N too")
    rec_raw = _recovery_dict(cfg, recover_steps, recovery_config) if recover_steps else None
    source = str(recovery_config or "<recovery>")
    if rec_raw is not None:  # checked now, before any work: the pruned model only changes the model section
        _recovery_config(rec_raw, overrides, source, out, cfg.model, f"{cfg.run.name}-pruned")
    src_data = data_dir(cfg)
    report: dict[str, Any] = {}

    def write(tmp: Path) -> None:
        run = build_run(cfg, "eval", weights_from=ckpt, weights=weights)
        model = run.model
        say(f"pruning {run.weights_from} (step {run.step}) by {_describe(spec, removed, model.cfg)}")
        before, params_before = _eval(run, model, eval_batches), _params(model)
        calib = None
        if spec.score == "wanda":
            calib = calibration_batches(run.tokenizer, cfg.seq_len, spec.calib_seqs, spec.calib, run.data)
        t0 = time.perf_counter()
        pruned, details = prune_model(model, spec, calib)
        prune_s = time.perf_counter() - t0
        after = _eval(run, pruned, eval_batches)
        own_data = cfg.data.dir is None  # the source's data lived in its run dir: the output gets a copy
        if own_data and src_data.is_dir():
            shutil.copytree(src_data, tmp / "data", symlinks=False)
        recovered, rec_info, step = None, None, 0
        if rec_raw is not None:
            from lmforge.train.trainer import Trainer

            rec_cfg = _recovery_config(rec_raw, overrides, source, tmp, pruned.cfg, f"{cfg.run.name}-pruned")
            unstructured = spec.method in ("magnitude", "2:4")
            keep = [KeepSparsity(include_head=spec.include_head)] if unstructured else []
            t0 = time.perf_counter()
            trainer = Trainer(rec_cfg, model=pruned, callbacks=keep)
            final = trainer.fit()
            rec_info = {"steps": trainer.step, "seconds": round(time.perf_counter() - t0, 2),
                        "final_train_loss": final.get("train_loss"), "lr": rec_cfg.optim.lr}
            recovered, step = _eval(run, pruned, eval_batches), trainer.step
            new_cfg = trainer.cfg
        else:
            CheckpointManager(tmp, keep_last=1).save(0, pruned, None, {})
            new_cfg = cfg.model_copy(update={
                "model": pruned.cfg.model_copy(update={"init_from": None}),
                "run": cfg.run.model_copy(update={"name": f"{cfg.run.name}-pruned", "overwrite": False}),
            })
        new_cfg = new_cfg.model_copy(update={"run": new_cfg.run.model_copy(update={"dir": str(out)})})
        save_config(new_cfg, tmp / "config.yaml")
        stats = sparsity_stats(pruned, spec.include_head)
        report.update({
            "source": str(run.weights_from), "source_step": run.step, "step": step,
            "spec": asdict(spec), **details, "prune_seconds": round(prune_s, 3),
            "model": {k: getattr(pruned.cfg, k) for k in ("n_heads", "n_kv_heads", "head_dim", "d_ff")},
            "params": {"before": params_before, "after": _params(pruned)},
            "sparsity": stats,
            "eval": {"split": cfg.eval.split, "before": before, "pruned": after, "recovered": recovered},
            "recovery": rec_info,
        })
        atomic_write_json(tmp / REPORT, report)

    write_output_dir(out, overwrite, [src, ckpt, src_data], write)
    for line in report_lines(report):
        say(line)
    say(f"wrote {out} (report: {out / REPORT})")
    return report


def _describe(spec: PruneSpec, removed: int, cfg: ModelConfig) -> str:
    score = "" if spec.score == "magnitude" else ", wanda scores"
    if spec.method == "magnitude":
        return f"magnitude to {spec.sparsity:.0%} sparsity ({spec.scope}{score})"
    if spec.method == "2:4":
        return f"2:4 semi-structured sparsity{score}"
    if spec.method == "heads":
        g = group_size(cfg)
        return (f"removing {removed * g} of {cfg.n_heads} heads per layer"
                + (f" ({removed} kv groups)" if g > 1 else "") + score)
    return f"removing {removed} of {cfg.resolved_d_ff} MLP channels per layer{score}"


def report_lines(report: dict[str, Any]) -> list[str]:
    """The report's headline numbers as lines of text."""
    p, s, e = report["params"], report["sparsity"], report["eval"]

    def loss(r: dict | None) -> str:
        return "-" if r is None else f"{r['loss']:.4f} (ppl {r['ppl']:.2f})"

    lines = [
        f"params {p['before']['total']:,} -> {p['after']['total']:,} ({p['after']['nonzero']:,} non-zero); "
        f"sparsity of the pruned weights {s['overall']:.2%}, of all parameters {s['of_all_params']:.2%}",
        f"{e['split']} loss: before {loss(e['before'])}, pruned {loss(e['pruned'])}, "
        f"recovered {loss(e['recovered'])}",
    ]
    if report.get("not_pruned"):
        n = report["not_pruned"]["moe_expert_params"]
        lines.append(f"not pruned: the mixture-of-experts layers' {n:,} parameters (experts and routers; "
                     "unstructured pruning reaches the attention and dense MLP projections only)")
    if report["recovery"]:
        r = report["recovery"]
        lines.append(f"recovery: {r['steps']} steps in {r['seconds']:.0f}s (lr {r['lr']:g})")
    return lines
