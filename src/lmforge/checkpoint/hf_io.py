"""`lmforge import` / `lmforge export`: Hugging Face model dirs in and out.

An imported model is an ordinary lmforge run at step 0: `<out>/config.yaml` (the model section
translated from the Hugging Face config), `<out>/checkpoints/step_00000000/` and the tokenizer files.
So `lmforge eval`, `lmforge generate`, `lmforge export` and `model.init_from` treat imported models,
trained runs and single checkpoints alike.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lmforge.checkpoint.manager import CheckpointManager
from lmforge.checkpoint.runs import check_rebuildable, is_hf_dir, load_model, run_config, run_tokenizer_file
from lmforge.config.load import save_config
from lmforge.config.schema import Config
from lmforge.data import Tokenizer
from lmforge.errors import LmforgeError

# Tokenizer-side files of a Hugging Face model dir that travel with the weights unchanged (the chat
# template lives in tokenizer_config.json or chat_template.jinja).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


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
    CheckpointManager(out, keep_last=1).save(0, model, None, {})
    save_config(cfg, out / "config.yaml")
    n = sum(p.numel() for p in model.parameters())
    say(f"imported {hf_dir} ({json.loads((hf_dir / 'config.json').read_text()).get('model_type')}, "
        f"{n / 1e6:.2f}M params) into {out}")
    return out


def export_hf(src: str | Path, out_dir: str | Path, overwrite: bool = False,
              max_shard_size: int = 5 * 2**30, say=print, weights: str = "model") -> Path:
    """Write the model at `src` (run dir, checkpoint dir or imported dir) as a Hugging Face model dir
    (`weights` 'ema' / 'swa': the weight average kept during training instead of the trained weights)."""
    from lmforge.models.hf import to_hf

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise LmforgeError(f"{out} is not empty; choose another output dir or pass --overwrite")
        shutil.rmtree(out)
    cfg, ckpt = run_config(src)
    check_rebuildable(cfg, ckpt)
    tok_path = run_tokenizer_file(cfg)
    if tok_path is None:
        raise LmforgeError(f"the tokenizer of {src} is missing; was data.dir moved?")
    tokenizer = Tokenizer.load(tok_path)
    model, step = load_model(cfg, ckpt, weights)
    tokenizer_dir = Path(cfg.data.tokenizer.path).parent if cfg.data.tokenizer.path else None
    eos = tokenizer.eos_id
    # lmforge's own tokenizers use one end-of-text token for both ends (GPT-2's convention).
    to_hf(model, out, max_shard_size=max_shard_size, bos_token_id=eos, eos_token_id=eos)
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer_config.json").is_file():
        for name in TOKENIZER_FILES:  # the original files: chat template and generation defaults included
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, out / name)
    else:
        tokenizer.save_hf(out, model_max_length=cfg.model.max_seq_len)
    which = "" if weights == "model" else f", {weights} weights"
    say(f"exported {ckpt} (step {step}{which}) to {out}")
    return out

