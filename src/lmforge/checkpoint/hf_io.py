"""`lmforge import` / `lmforge export`: Hugging Face model dirs in and out.

An imported model is an ordinary lmforge run at step 0: `<out>/config.yaml` (the model section
translated from the Hugging Face config), `<out>/checkpoints/step_00000000/` and the tokenizer files.
So `lmforge eval`, `lmforge generate`, `lmforge export` and `model.init_from` treat imported models,
trained runs and single checkpoints alike.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from lmforge.checkpoint.manager import CheckpointManager
from lmforge.checkpoint.runs import check_rebuildable, is_hf_dir, load_model, run_config, run_tokenizer_file
from lmforge.config.load import save_config
from lmforge.config.methods import default_method
from lmforge.config.schema import Config
from lmforge.data import Tokenizer
from lmforge.errors import LmforgeError
from lmforge.utils.io import fsync_dir

# Tokenizer-side files of a Hugging Face model dir that travel with the weights unchanged (the chat
# template lives in tokenizer_config.json or chat_template.jinja).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def write_output_dir(out: Path, overwrite: bool, inputs: list[Path], write: Callable[[Path], None]) -> Path:
    """Build an output dir beside `out` with `write(tmp)` and swap it in at the end, so that a failure
    (a bad input found late, a full disk) leaves whatever `out` held untouched. Checked first: `out`
    is a directory or absent, empty unless `overwrite`, and neither is, holds nor lies inside an input."""
    target = out.resolve()
    for inp in inputs:
        src = inp.resolve()
        if src == target or target in src.parents or src in target.parents:
            raise LmforgeError(f"{out} is, holds or lies inside {inp}, an input of this command; choose "
                               "another output dir")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise LmforgeError(f"{out} exists and is not a directory; choose another output dir")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise LmforgeError(f"{out} is not empty; choose another output dir or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the output from other users
        write(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def import_hf(hf_dir: str | Path, out_dir: str | Path, overwrite: bool = False, say=print) -> Path:
    """Convert a Hugging Face model dir into an lmforge run at step 0. Returns `out_dir`."""
    from lmforge.models.hf import from_hf, read_hf_config
    from lmforge.models.hf.convert import hf_dir_model_config

    hf_dir, out = Path(hf_dir), Path(out_dir)
    if not is_hf_dir(hf_dir):
        raise LmforgeError(f"{hf_dir} is not a Hugging Face model dir (no config.json)")
    hf_cfg = read_hf_config(hf_dir)
    model_cfg = hf_dir_model_config(hf_dir)
    # In the checkpoint's own floating dtype: a bf16 model needs its own size in memory, not twice
    # that (the step-0 checkpoint keeps it; a run that loads it casts to its own precision).
    import torch

    stored = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        str(hf_cfg.get("dtype") or hf_cfg.get("torch_dtype")), torch.float32)
    model = from_hf(hf_dir, dtype=stored)  # everything read and checked before the output is touched

    def write(tmp: Path) -> None:
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                shutil.copy2(hf_dir / name, tmp / name)
        has_tokenizer = (tmp / "tokenizer.json").is_file()
        cfg = Config.model_validate({
            "run": {"name": hf_dir.name, "dir": str(out)},
            "model": model_cfg.model_dump(),
            # an encoder (BERT / RoBERTa) or T5 is evaluated as what it was trained for: masked LM, span
            # corruption
            **({"objective": {"name": default_method(model_cfg.arch)}}
               if model_cfg.arch != "decoder" else {}),
            "data": {"tokenizer": {"path": str(out / "tokenizer.json")}} if has_tokenizer else {},
        })
        CheckpointManager(tmp, keep_last=1).save(0, model, None, {})
        save_config(cfg, tmp / "config.yaml")

    write_output_dir(out, overwrite, [hf_dir], write)
    n = sum(p.numel() for p in model.parameters())
    say(f"imported {hf_dir} ({hf_cfg.get('model_type')}, {n / 1e6:.2f}M params) into {out}")
    return out


def export_hf(src: str | Path, out_dir: str | Path, overwrite: bool = False,
              max_shard_size: int = 5 * 2**30, say=print, weights: str = "model", load=load_model,
              chat_template: str | None = None, end_of_turn: str | None = None) -> Path:
    """Write the model at `src` (run dir, checkpoint dir or imported dir) as a Hugging Face model dir
    (`weights` 'ema' / 'swa': the weight average kept during training instead of the trained weights).

    `load(cfg, checkpoint, weights) -> (Transformer, step)` builds the model (a fine-tuned run's
    loader merges its adapters); `chat_template` goes into tokenizer_config.json, and generation stops
    at `end_of_turn` as well as at EOS."""
    from lmforge.models.hf import to_hf

    out = Path(out_dir)
    cfg, ckpt = run_config(src)
    check_rebuildable(cfg, ckpt)
    tok_path = run_tokenizer_file(cfg)
    if tok_path is None:
        raise LmforgeError(f"the tokenizer of {src} is missing; was data.dir moved?")
    tokenizer = Tokenizer.load(tok_path)
    model, step = load(cfg, ckpt, weights)  # everything read and checked before the output is touched
    tokenizer_dir = Path(cfg.data.tokenizer.path).parent if cfg.data.tokenizer.path else None
    turn_end = tokenizer.token_id(end_of_turn) if end_of_turn else None

    def write(tmp: Path) -> None:
        eos = tokenizer.eos_id
        stops = eos if turn_end is None or turn_end == eos else [eos, turn_end]
        # lmforge's own tokenizers use one end-of-text token for both ends (GPT-2's convention).
        # a reward model (sequence classification) finds each row's last token by its padding id
        pad = eos if getattr(model.cfg, "score_head", False) else None
        to_hf(model, tmp, max_shard_size=max_shard_size, bos_token_id=eos, eos_token_id=stops,
              pad_token_id=pad)
        if chat_template is not None:  # a fine-tuned run: its tokenizer (template tokens added) and template
            tokenizer.save_hf(tmp, model_max_length=cfg.model.max_seq_len, chat_template=chat_template)
        elif tokenizer_dir is not None and (tokenizer_dir / "tokenizer_config.json").is_file():
            for name in TOKENIZER_FILES:  # the original files: chat template and generation defaults included
                if (tokenizer_dir / name).is_file():
                    shutil.copy2(tokenizer_dir / name, tmp / name)
        else:
            tokenizer.save_hf(tmp, model_max_length=cfg.model.max_seq_len)

    inputs = [Path(src), ckpt, tok_path] + ([tokenizer_dir] if tokenizer_dir is not None else [])
    write_output_dir(out, overwrite, inputs, write)
    which = "" if weights == "model" else f", {weights} weights"
    say(f"exported {ckpt} (step {step}{which}) to {out}")
    return out
