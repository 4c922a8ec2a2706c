"""`lmforge eval` and `lmforge generate`: load a trained run (or one checkpoint of it) and use it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lmforge.checkpoint.hf_io import find_weights, is_hf_dir, run_tokenizer_file
from lmforge.checkpoint.manager import load_states
from lmforge.config.load import config_from_dict, load_config
from lmforge.config.schema import Config
from lmforge.data import Tokenizer, TokenLoader, data_dir, prepare
from lmforge.errors import LmforgeError
from lmforge.eval.generate import generate
from lmforge.eval.perplexity import evaluate_loss
from lmforge.models import Transformer, build_model
from lmforge.parallel.world import World, resolve_device
from lmforge.train.precision import Precision, resolve_precision
from lmforge.utils.io import atomic_write_json


@dataclass
class LoadedRun:
    cfg: Config
    run_dir: Path
    checkpoint: Path
    step: int
    model: Transformer
    tokenizer: Tokenizer
    device: torch.device


def load_run(path: str | Path, overrides: list[str] | tuple[str, ...] = (),
             weights: str = "model") -> LoadedRun:
    """Rebuild the model of a run from its resolved config.yaml and load checkpoint weights
    (`weights`: the trained ones, or their 'ema' / 'swa' average kept during training)."""
    path = Path(path)
    if not path.exists():
        raise LmforgeError(f"no such run or checkpoint: {path}")
    if is_hf_dir(path):
        if weights != "model":
            raise LmforgeError(f"{path} is a Hugging Face model dir: it has no {weights} weights")
        return _load_hf_dir(path, overrides)
    run_dir, ckpt = find_weights(path)
    cfg = load_config(run_dir / "config.yaml", overrides)
    cfg.run.dir = str(run_dir)  # where the run actually is now, whatever the cwd was at training time
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.train.device, World.from_env())
    tok_path = run_tokenizer_file(cfg)
    if tok_path is None:
        raise LmforgeError(f"the tokenizer of run {run_dir} is missing ({data_dir(cfg) / 'tokenizer.json'}); "
                           "was data.dir moved?")
    tokenizer = Tokenizer.load(tok_path)
    model = build_model(cfg.model, device=device)
    step = load_states(ckpt, model, weights=weights)
    model.eval()
    return LoadedRun(cfg, run_dir, ckpt, step, model, tokenizer, device)


def _load_hf_dir(path: Path, overrides) -> LoadedRun:
    """A Hugging Face model dir used directly (no import step): step 0, its own tokenizer."""
    from lmforge.models.hf import from_hf, hf_to_model_config

    model_cfg = hf_to_model_config(json.loads((path / "config.json").read_text()))
    cfg = config_from_dict({"run": {"dir": str(path)}, "model": model_cfg.model_dump(),
                            "data": {"tokenizer": {"path": str(path / "tokenizer.json")}}},
                           overrides, source=str(path / "config.json"))
    device = resolve_device(cfg.train.device, World.from_env())
    if not (path / "tokenizer.json").is_file():
        raise LmforgeError(f"{path} has no tokenizer.json; lmforge needs a fast (tokenizers) tokenizer file")
    model = from_hf(path, device=device)
    model.eval()
    return LoadedRun(cfg, path, path, 0, model, Tokenizer.load(path / "tokenizer.json"), device)


def evaluate(path: str | Path, overrides: list[str] | tuple[str, ...] = (), say=print,
             weights: str = "model") -> dict[str, float]:
    """Loss, perplexity and bits per byte of a run's checkpoint on its validation (or train) split."""
    run = load_run(path, overrides, weights)
    cfg = run.cfg
    data = prepare(cfg, console=lambda *_: None)
    loader = TokenLoader(data.shards(cfg.eval.split), cfg.seq_len, cfg.eval.batch_size,
                         shuffle=False, drop_last=False)
    name = resolve_precision(cfg.train.precision, run.device, run.model, cfg.eval.batch_size, cfg.seq_len,
                             cfg.model.vocab_size, backward=False)
    precision = Precision(name, run.device)
    token_bytes = torch.as_tensor(run.tokenizer.token_byte_lengths(), dtype=torch.long)
    out = evaluate_loss(run.model, loader.iter_eval_batches(cfg.eval.max_batches), precision, token_bytes,
                        run.device)
    result = {"step": run.step, "split": cfg.eval.split, "weights": weights, **out}
    suffix = "" if weights == "model" else f"_{weights}"
    atomic_write_json(run.run_dir / f"eval_{cfg.eval.split}_step_{run.step:08d}{suffix}.json", result)
    say(f"{run.checkpoint}{suffix} ({cfg.eval.split}, {out['tokens']:,} tokens): loss {out['loss']:.4f}  "
        f"ppl {out['ppl']:.2f}" + (f"  bpb {out['bpb']:.4f}" if "bpb" in out else ""))
    return result


def generate_text(path: str | Path, overrides: list[str] | tuple[str, ...] = (),
                  weights: str = "model") -> list[str]:
    """Continue `generate.prompt` with a run's checkpoint; returns prompt + continuation per sample."""
    run = load_run(path, overrides, weights)
    g = run.cfg.generate
    prompt_ids = run.tokenizer.encode(g.prompt) if g.prompt else [run.tokenizer.eos_id]
    outs = generate(run.model, prompt_ids, g.max_new_tokens, temperature=g.temperature, top_k=g.top_k,
                    top_p=g.top_p, num_samples=g.num_samples, seed=g.seed, eos_id=run.tokenizer.eos_id,
                    device=run.device)
    prefix = prompt_ids if g.prompt else []
    return [run.tokenizer.decode(prefix + ids) for ids in outs]
