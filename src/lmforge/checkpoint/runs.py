"""Finding what a path holds (a run dir, one checkpoint of it, or a Hugging Face model dir), the
config that belongs to its weights, and loading those weights into a model.

Building a run from a config is the assembly's job (`lmforge.assembly`); this module answers "where
are the weights, which architecture and tokenizer go with them" and fills a model with them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from lmforge.checkpoint.manager import list_checkpoints, load_states
from lmforge.config.load import config_from_dict, load_config
from lmforge.config.schema import Config, ModelConfig
from lmforge.data import data_dir
from lmforge.errors import ConfigError, LmforgeError


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / "config.yaml").is_file()


def find_weights(path: Path) -> tuple[Path, Path]:
    """(run dir, checkpoint dir) for a run dir (its latest checkpoint) or one checkpoint dir."""
    if (path / "meta.json").is_file() and path.parent.name == "checkpoints":
        return path.parent.parent, path
    if (path / "config.yaml").is_file():
        ckpts = list_checkpoints(path / "checkpoints")
        if not ckpts:
            raise LmforgeError(f"run dir {path} has no checkpoint yet; train it first (lmforge train)")
        return path, ckpts[-1].path
    raise LmforgeError(
        f"{path} is not a run dir (config.yaml), a checkpoint dir (runs/X/checkpoints/step_N) "
        "or a Hugging Face model dir (config.json)"
    )


def _hf_model_config(path: Path) -> ModelConfig:
    from lmforge.models.hf.convert import hf_dir_model_config

    return hf_dir_model_config(path)


def run_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, Path]:
    """The config that goes with the weights at `path`, and the dir the weights are in.

    A run dir or checkpoint dir: the run's resolved config.yaml, with run.dir where the run is now
    (whatever the cwd was at training time). A Hugging Face dir: its architecture and tokenizer as a
    config whose run.dir is that dir. `overrides` are `--set` items applied on top.
    """
    path = Path(path)
    if not path.exists():
        raise LmforgeError(f"no such run or checkpoint: {path}")
    if is_hf_dir(path):
        if not (path / "tokenizer.json").is_file():
            raise LmforgeError(
                f"{path} has no tokenizer.json; lmforge needs a fast (tokenizers) tokenizer file"
            )
        model = _hf_model_config(path)
        raw = {"run": {"dir": str(path)}, "model": model.model_dump(),
               "data": {"tokenizer": {"path": str(path / "tokenizer.json")}}}
        if model.arch != "decoder":  # an encoder or T5: the method it pretrained with (what fits its arch)
            from lmforge.config.methods import default_method

            raw["objective"] = {"name": default_method(model.arch)}
        return config_from_dict(raw, overrides, source=str(path / "config.json")), path
    run_dir, ckpt = find_weights(path)
    cfg = load_config(run_dir / "config.yaml", [*overrides, f"run.dir={json.dumps(str(run_dir))}"])
    return cfg, ckpt


def source_model_config(path: str | Path) -> ModelConfig:
    """The architecture stored with weights at `path` (HF dir, run dir or checkpoint dir)."""
    path = Path(path)
    if not path.exists():
        raise LmforgeError(f"no such model, run or checkpoint: {path}")
    if is_hf_dir(path):
        return _hf_model_config(path)
    run_dir, _ = find_weights(path)
    return load_config(run_dir / "config.yaml").model


def source_tokenizer(path: str | Path) -> Path | None:
    """The tokenizer.json that belongs to the weights at `path`, if there is one."""
    path = Path(path)
    if is_hf_dir(path):
        tok = path / "tokenizer.json"
        return tok if tok.is_file() else None
    cfg, _ = run_config(path)
    return run_tokenizer_file(cfg)


def run_tokenizer_file(cfg: Config) -> Path | None:
    """A run's tokenizer: the one its data prep wrote, else (an imported model) the one it names."""
    tok = data_dir(cfg) / "tokenizer.json"
    if not tok.is_file() and cfg.data.tokenizer.path:
        tok = Path(cfg.data.tokenizer.path)
    return tok if tok.is_file() else None


# Keys of the model section that do not change the architecture: they may differ from the source.
_FREE_KEYS = {"init_from", "dropout", "attention_dropout", "hidden_dropout", "init_std", "preset"}
# Keys a fine-tuning run derives on top of its source and records in its config.yaml: the vocabulary grown
# for a chat template's new tokens, the scalar head its objective adds. A run started from that file (to
# resume it) states them again; they are the run's, not the source's, so with `derived` they are left to
# the caller, which checks them against what it derives (assembly/build.py).
DERIVED_KEYS = frozenset({"vocab_size", "score_head", "value_head", "num_labels", "score_reads"})


def resolve_init_from(cfg: Config, say=print, derived: bool = False) -> Config:
    """`cfg` made to start from `model.init_from`: its architecture, and its tokenizer unless one is
    set (a new config; `cfg` is unchanged). Keys the user set explicitly in `model` must agree with
    the source (dropout may differ; with `derived`, DERIVED_KEYS are the caller's to check)."""
    src = cfg.model.init_from
    if not src:
        return cfg
    source = source_model_config(src)
    check_whole_weights(src)
    free = _FREE_KEYS | (DERIVED_KEYS if derived else set())
    conflicts = [
        f"model.{k}={getattr(cfg.model, k)!r} (the weights have {getattr(source, k)!r})"
        for k in sorted(cfg.model.model_fields_set - free)
        if getattr(cfg.model, k) != getattr(source, k)
    ]
    if conflicts:
        raise ConfigError(f"model.init_from={src}: these keys contradict the weights: "
                          f"{'; '.join(conflicts)}; remove them (the architecture comes from the weights)")
    keep = {k: getattr(cfg.model, k) for k in ("dropout", "attention_dropout", "hidden_dropout")
            if k in cfg.model.model_fields_set}
    update: dict = {"model": source.model_copy(update={**keep, "init_from": src, "preset": None})}
    if cfg.data.tokenizer.path is None:
        tok = source_tokenizer(src)
        if tok is None:
            raise ConfigError(f"model.init_from={src} has no tokenizer.json next to it; set "
                              "data.tokenizer.path to the tokenizer the weights were trained with")
        tokenizer = cfg.data.tokenizer.model_copy(update={"path": str(tok)})
        update["data"] = cfg.data.model_copy(update={"tokenizer": tokenizer})
        say(f"model.init_from: using its tokenizer {tok}")
    return cfg.model_copy(update=update)


def check_whole_weights(src: str | Path, key: str = "model.init_from") -> None:
    """Refuse to start from an adapter run (LoRA, DoRA, QLoRA): its checkpoints hold adapters beside a
    frozen base, not the model a new run starts from. The fix is one command: merge them first."""
    path = Path(src)
    if is_hf_dir(path):
        return
    run_dir, _ = find_weights(path)
    method = load_config(run_dir / "config.yaml").finetune.method
    if method != "full":
        raise ConfigError(f"{key}={src} is a finetune.method={method} run: its checkpoints hold adapters "
                          "beside a frozen base, not a whole model to start from; fold them in first "
                          f"(lmforge merge {src} MERGED) and set {key}=MERGED")


def load_weights(path: str | Path, model: nn.Module, weights: str = "model") -> int:
    """Load the weights at `path` (HF dir, run dir or checkpoint dir) into a materialised model;
    `weights` 'ema' / 'swa' picks a weight average a run kept. Returns the checkpoint's step (0 for
    a Hugging Face dir)."""
    path = Path(path)
    if is_hf_dir(path):
        if weights != "model":
            raise LmforgeError(f"{path} is a Hugging Face model dir: it has no {weights} weights")
        from lmforge.models.hf import load_pretrained

        load_pretrained(path, model)
        return 0
    return load_states(find_weights(path)[1], model, weights=weights)


def check_rebuildable(cfg: Config, path: str | Path) -> None:
    """Refuse a run whose model its config cannot rebuild: one trained with a model object of its own
    (every resolved config of lmforge's Transformer has a vocabulary size; those runs have none)."""
    if cfg.model.vocab_size is None and not is_hf_dir(Path(path)):
        raise LmforgeError(
            f"{path} was trained with a model object of its own (lmforge.Trainer(model=...)), which its "
            "config cannot rebuild; load the weights into that module with "
            "lmforge.checkpoint.manager.load_states(checkpoint_dir, module)"
        )


def load_model(cfg: Config, path: str | Path, weights: str = "model",
               device: torch.device | str = "cpu") -> tuple[nn.Module, int]:
    """The model `cfg.model` describes, filled with the weights at `path`, in eval mode; and the
    step they were saved at."""
    path = Path(path)
    if is_hf_dir(path):
        if weights != "model":
            raise LmforgeError(f"{path} is a Hugging Face model dir: it has no {weights} weights")
        from lmforge.models.hf import from_hf

        model, step = from_hf(path, device=device), 0  # streamed into a meta-device model
    else:
        from lmforge.models import build_model

        check_rebuildable(cfg, path)
        model = build_model(cfg.model, device=device)
        step = load_weights(path, model, weights)
    return model.eval(), step
