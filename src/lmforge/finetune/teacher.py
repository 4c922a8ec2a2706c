"""The teacher of knowledge distillation (objective distill): a frozen model loaded from a run dir,
checkpoint dir or Hugging Face dir (a fine-tuned or quantized run too), checked to share the
student's vocabulary, and handed to the objective as batch -> logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.checkpoint.runs import run_config, source_tokenizer
from lmforge.data.batch import TokenBatch
from lmforge.engine.loss import logits_of
from lmforge.errors import ConfigError


def load_teacher(path: str | Path, weights: str, student_vocab: int, student_tokenizer: Any,
                 device: torch.device, say=print, key: str = "distill.teacher") -> nn.Module:
    """The teacher model at `path`, frozen and in eval mode on `device`. Refused (ConfigError) unless
    its tokenizer maps every token to the same id as the student's and its vocabulary size (rows of
    the output layer) equals the student's: the divergence compares distributions id by id. `key`: the
    config key that names the teacher, for messages."""
    from lmforge.data.tokenizer import Tokenizer
    from lmforge.finetune.setup import load_finetuned

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{key}={path}: no such run, checkpoint or Hugging Face dir")
    cfg, source = run_config(path)
    tok_file = source_tokenizer(path)
    if tok_file is None:
        raise ConfigError(f"{key}={path} has no tokenizer.json next to its weights, so its "
                          "vocabulary cannot be checked against the student's")
    if student_tokenizer is not None:
        theirs = Tokenizer.load(tok_file).hf.get_vocab()
        ours = Tokenizer.of(student_tokenizer).hf.get_vocab()
        if theirs != ours:
            differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
            raise ConfigError(
                f"{key}={path}: its tokenizer ({tok_file}, {len(theirs)} tokens) is not the "
                f"student's ({len(ours)} tokens; e.g. {differ}); distillation compares distributions token "
                "id by token id: prepare the student's data with the teacher's tokenizer "
                f"(data.tokenizer.path={tok_file})"
            )
    if cfg.model.vocab_size != student_vocab:
        raise ConfigError(
            f"{key}={path} has model.vocab_size={cfg.model.vocab_size}, the student "
            f"{student_vocab}; set the student's model.vocab_size={cfg.model.vocab_size}"
        )
    with torch.random.fork_rng(devices=[]):  # its random init (overwritten) must not move the run's RNG
        model, step = load_finetuned(cfg, source, weights, device)
    model.requires_grad_(False).eval()
    n = sum(p.numel() for p in model.parameters())
    say(f"teacher: {path} (step {step}, {n / 1e6:.2f}M parameters), frozen")
    return model


def teacher_logits(model: nn.Module):
    """batch -> the teacher's logits (B, T, V), without gradients; the teacher stays in eval mode."""
    dev = next(model.parameters()).device

    def logits(batch: TokenBatch) -> torch.Tensor:
        with torch.no_grad():
            return logits_of(model(batch.input_ids.to(dev)))

    return logits
