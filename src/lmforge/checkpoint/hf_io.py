"""`lmforge import` / `lmforge export`, and starting a run from existing weights (`model.init_from`).

An imported model is an ordinary lmforge run at step 0: `<out>/config.yaml` (the model section
translated from the Hugging Face config), `<out>/checkpoints/step_00000000/` and the tokenizer files.
So `lmforge eval`, `lmforge generate`, `lmforge export` and `model.init_from` treat imported models,
trained runs and single checkpoints alike.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from torch import nn

from lmforge.checkpoint.manager import CheckpointManager, list_checkpoints, load_states
from lmforge.config.load import load_config, save_config
from lmforge.config.schema import Config, ModelConfig
from lmforge.errors import ConfigError, LmforgeError

# Tokenizer-side files of a Hugging Face model dir that travel with the weights unchanged (the chat
# template lives in tokenizer_config.json or chat_template.jinja).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


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


def source_model_config(path: str | Path) -> ModelConfig:
    """The architecture stored with weights at `path` (HF dir, run dir or checkpoint dir)."""
    path = Path(path)
    if not path.exists():
        raise LmforgeError(f"no such model, run or checkpoint: {path}")
    if is_hf_dir(path):
        from lmforge.models.hf import hf_to_model_config

        return hf_to_model_config(json.loads((path / "config.json").read_text()))
    run_dir, _ = find_weights(path)
    return load_config(run_dir / "config.yaml").model


def source_tokenizer(path: str | Path) -> Path | None:
    """The tokenizer.json that belongs to the weights at `path`, if there is one."""
    path = Path(path)
    if is_hf_dir(path):
        tok = path / "tokenizer.json"
        return tok if tok.is_file() else None
    run_dir, _ = find_weights(path)
    cfg = load_config(run_dir / "config.yaml")
    cfg.run.dir = str(run_dir)
    return run_tokenizer_file(cfg)


def run_tokenizer_file(cfg: Config) -> Path | None:
    """A run's tokenizer: the one its data prep wrote, else (an imported model) the one it names."""
    from lmforge.data import data_dir

    tok = data_dir(cfg) / "tokenizer.json"
    if not tok.is_file() and cfg.data.tokenizer.path:
        tok = Path(cfg.data.tokenizer.path)
    return tok if tok.is_file() else None


# Keys of the model section that do not change the architecture: they may differ from the source.
_FREE_KEYS = {"init_from", "dropout", "init_std", "preset"}


def apply_init_from(cfg: Config, say=print) -> None:
    """Make `cfg` start from `model.init_from`: its architecture, and its tokenizer unless one is set.

    Keys the user set explicitly in `model` must agree with the source (dropout may differ).
    """
    src = cfg.model.init_from
    source = source_model_config(src)
    conflicts = [
        f"model.{k}={getattr(cfg.model, k)!r} (the weights have {getattr(source, k)!r})"
        for k in sorted(cfg.model.model_fields_set - _FREE_KEYS)
        if getattr(cfg.model, k) != getattr(source, k)
    ]
    if conflicts:
        raise ConfigError(f"model.init_from={src}: these keys contradict the weights: "
                          f"{'; '.join(conflicts)}; remove them (the architecture comes from the weights)")
    update = {k: getattr(cfg.model, k) for k in ("dropout",) if k in cfg.model.model_fields_set}
    cfg.model = source.model_copy(update={**update, "init_from": src, "preset": None})
    if cfg.data.tokenizer.path is None:
        tok = source_tokenizer(src)
        if tok is None:
            raise ConfigError(f"model.init_from={src} has no tokenizer.json next to it; set "
                              "data.tokenizer.path to the tokenizer the weights were trained with")
        cfg.data.tokenizer.path = str(tok)
        say(f"model.init_from: using its tokenizer {tok}")


def load_init_weights(path: str | Path, model: nn.Module) -> None:
    """Load the weights at `path` (HF dir, run dir or checkpoint dir) into a materialised model."""
    path = Path(path)
    if is_hf_dir(path):
        from lmforge.models.hf import load_pretrained

        load_pretrained(path, model)
    else:
        load_states(find_weights(path)[1], model)


def import_hf(hf_dir: str | Path, out_dir: str | Path, overwrite: bool = False, say=print) -> Path:
    """Convert a Hugging Face model dir into an lmforge run at step 0. Returns `out_dir`."""
    from lmforge.models.hf import from_hf, hf_to_model_config

    hf_dir, out = Path(hf_dir), Path(out_dir)
    if not is_hf_dir(hf_dir):
        raise LmforgeError(f"{hf_dir} is not a Hugging Face model dir (no config.json)")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise LmforgeError(f"{out} is not empty; choose another output dir or pass --overwrite")
        shutil.rmtree(out)
    model_cfg = hf_to_model_config(json.loads((hf_dir / "config.json").read_text()))
    model = from_hf(hf_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, out / name)
    cfg = Config.model_validate({
        "run": {"name": hf_dir.name, "dir": str(out)},
        "model": model_cfg.model_dump(),
        "data": {"tokenizer": {"path": str(out / "tokenizer.json")}} if (out / "tokenizer.json").is_file()
        else {},
    })
    CheckpointManager(out, keep_last=1).save(0, model, None, {"step": 0})
    save_config(cfg, out / "config.yaml")
    n = sum(p.numel() for p in model.parameters())
    say(f"imported {hf_dir} ({json.loads((hf_dir / 'config.json').read_text()).get('model_type')}, "
        f"{n / 1e6:.2f}M params) into {out}")
    return out


def export_hf(src: str | Path, out_dir: str | Path, overwrite: bool = False,
              max_shard_size: int = 5 * 2**30, say=print, weights: str = "model") -> Path:
    """Write the model at `src` (run dir, checkpoint dir or imported dir) as a Hugging Face model dir
    (`weights` 'ema' / 'swa': the weight average kept during training instead of the trained weights)."""
    from lmforge.eval.entry import load_run
    from lmforge.models.hf import to_hf

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise LmforgeError(f"{out} is not empty; choose another output dir or pass --overwrite")
        shutil.rmtree(out)
    run = load_run(src, weights=weights)
    tokenizer_dir = Path(run.cfg.data.tokenizer.path).parent if run.cfg.data.tokenizer.path else None
    eos = run.tokenizer.eos_id
    # lmforge's own tokenizers use one end-of-text token for both ends (GPT-2's convention).
    to_hf(run.model, out, max_shard_size=max_shard_size, bos_token_id=eos, eos_token_id=eos)
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer_config.json").is_file():
        for name in TOKENIZER_FILES:  # the original files: chat template and generation defaults included
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, out / name)
    else:
        run.tokenizer.save_hf(out, model_max_length=run.cfg.model.max_seq_len)
    which = "" if weights == "model" else f", {weights} weights"
    say(f"exported {run.checkpoint} (step {run.step}{which}) "
        f"to {out}")
    return out

