"""The DeepSpeed / TrainingArguments flags of `lmforge config` and `lmforge train`: read the file, translate
it (config/translate_deepspeed.py, config/translate_hf.py) and put it under the user's -c and --set."""

from __future__ import annotations

import argparse
import os
import sys


def _world_size() -> int:
    """Processes of this run: torchrun's WORLD_SIZE, else one (DeepSpeed's batch check needs it)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def translate_files(args: argparse.Namespace):
    """The Translation of --from-deepspeed / --deepspeed and --from-hf-args given on the command line
    (None when none is), merged: a key both set differently is a ConfigError."""
    from lmforge.config.load import load_config
    from lmforge.config.translate import read_mapping
    from lmforge.config.translate_deepspeed import translate_deepspeed
    from lmforge.config.translate_hf import translate_hf_args

    ds_path = getattr(args, "from_deepspeed", None) or getattr(args, "deepspeed", None)
    hf_path = getattr(args, "from_hf_args", None)
    if not ds_path and not hf_path:
        return None
    out = None
    if hf_path:
        # A fraction of the run (warmup_ratio) needs its length: the user's config's, when the
        # arguments train by epochs.
        max_steps = load_config(args.config, args.set).train.max_steps
        out = translate_hf_args(read_mapping(hf_path, "TrainingArguments"), hf_path, _world_size(), max_steps)
    if ds_path:
        ds = translate_deepspeed(read_mapping(ds_path, "DeepSpeed config"), ds_path, _world_size())
        if out is None:
            out = ds
        else:
            out.merge(ds)
    return out


def translated_config(args: argparse.Namespace, *, warn: bool):
    """The config of -c and --set with the translated files under them; `warn`: one stderr line per key
    that did not map (from rank 0). Returns (config, translation or None)."""
    from lmforge.cli.verbs.base import load_config
    from lmforge.config.translate import apply_translation

    t = translate_files(args)
    if t is None:
        return load_config(args), None
    cfg = apply_translation(t, args.config, args.set)
    if warn and os.environ.get("RANK", "0") == "0":
        from lmforge.config.translate import is_empty

        for key, value, why in t.unmapped:
            if is_empty(value):
                continue  # null / false / empty: asks for nothing (`lmforge config` still lists it)
            print(f"lmforge {args.verb}: warning: {t.source}: {key}={value!r} not translated: {why}",
                  file=sys.stderr)
    return cfg, t


def print_unmapped(t) -> None:
    """The table of keys that did not map, on stderr (stdout holds the config, for `> run.yaml`)."""
    from rich.console import Console

    from lmforge.config.translate import unmapped_table

    console = Console(stderr=True, highlight=False)
    table = unmapped_table(t)
    mapped = len(t.values)
    console.print(f"{t.source}: {mapped} lmforge keys set, {len(t.unmapped)} keys not translated",
                  markup=False, soft_wrap=True)
    if table is not None:
        console.print(table)
