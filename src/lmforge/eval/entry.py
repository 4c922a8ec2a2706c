"""`lmforge eval` and `lmforge generate`: a trained run (or one checkpoint of it, or a Hugging Face
model dir) assembled for evaluation or sampling, and used."""

from __future__ import annotations

from pathlib import Path

from lmforge.assembly import Run, build_run
from lmforge.checkpoint.runs import run_config
from lmforge.engine.evaluate import evaluate_loss
from lmforge.eval.generate import generate
from lmforge.utils.io import atomic_write_json


def load_run(path: str | Path, overrides: list[str] | tuple[str, ...] = (), weights: str = "model") -> Run:
    """The model and tokenizer of a run dir, checkpoint dir or Hugging Face dir (`weights`: the
    trained ones, or their 'ema' / 'swa' average kept during training)."""
    cfg, source = run_config(path, overrides)
    return build_run(cfg, "generate", weights_from=source, weights=weights)


def evaluate(path: str | Path, overrides: list[str] | tuple[str, ...] = (), say=print,
             weights: str = "model") -> dict[str, float]:
    """Loss, perplexity and bits per byte of a run's checkpoint on its validation (or train) split."""
    cfg, source = run_config(path, overrides)
    run = build_run(cfg, "eval", weights_from=source, weights=weights)
    out = evaluate_loss(run.model, run.val_loader.iter_eval_batches(run.eval_batches), run.objective,
                        precision=run.precision, token_bytes=run.token_bytes, device=run.device)
    result = {"step": run.step, "split": cfg.eval.split, "weights": weights, **out}
    suffix = "" if weights == "model" else f"_{weights}"
    atomic_write_json(run.run_dir / f"eval_{cfg.eval.split}_step_{run.step:08d}{suffix}.json", result)
    say(f"{run.weights_from}{suffix} ({cfg.eval.split}, {out['tokens']:,} tokens): loss {out['loss']:.4f}  "
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
