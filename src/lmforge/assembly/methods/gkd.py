"""Generalized knowledge distillation setup (objective gkd, over conversations): the teacher (a frozen
model sharing the student's tokenizer, chat template tokens included), the loaders of the sft section's
chat data whose training batches carry the seed of their on-policy draw, and the sampler that replaces a
batch's completions by the student's own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from lmforge.assembly.methods.base import MethodSetup, SetupContext
from lmforge.assembly.methods.reference import device_of
from lmforge.config.schema import Config
from lmforge.data.batch import IGNORE_INDEX, ChatBatch
from lmforge.data.chat_loader import ChatLoader
from lmforge.engine.loss import logits_of
from lmforge.engine.objectives.gkd import GKD, GKDBatch
from lmforge.errors import ConfigError


class GKDSetup(MethodSetup):
    names = (GKD.name,)

    def check_inputs(self, cfg: Config) -> None:
        if not cfg.gkd.teacher:
            raise ConfigError("objective gkd needs a teacher: set gkd.teacher to a run dir, checkpoint dir "
                              "or Hugging Face dir that shares the student's tokenizer")
        if not Path(cfg.gkd.teacher).exists():
            raise ConfigError(f"gkd.teacher={cfg.gkd.teacher}: no such run, checkpoint or Hugging Face dir")
        if cfg.gkd.lmbda > 0 and cfg.sft.loss_on == "all":
            raise ConfigError(f"gkd.lmbda={cfg.gkd.lmbda} samples a completion for each conversation's "
                              "prompt (its tokens before its last assistant turn), and sft.loss_on=all marks "
                              "every token as completion, leaving no prompt: set sft.loss_on=assistant or "
                              "last, or gkd.lmbda=0")

    def attach(self, objective, ctx: SetupContext):
        if not isinstance(objective, GKD):
            return None
        dims = ctx.dims
        if dims.tp > 1 or dims.pp > 1:
            raise ConfigError("objective gkd keeps the whole teacher on each rank and compares whole "
                              "vocabulary rows: one process, DDP or FSDP, not tensor or pipeline parallelism")
        if objective.teacher is None:
            objective.teacher = teacher(ctx.cfg, ctx.tokenizer, ctx.device, ctx.say)
        if objective.sampler is None and objective.lmbda > 0:
            if dims.fsdp:
                raise ConfigError(f"objective gkd with gkd.lmbda={objective.lmbda} samples completions with "
                                  "the whole student on each rank: one process or DDP, not FSDP (or set "
                                  "gkd.lmbda=0)")
            objective.sampler = OnPolicy(ctx.model, ctx.cfg, ctx.data)
        return None

    def attach_eval(self, run, data) -> None:
        if isinstance(run.objective, GKD) and run.objective.teacher is None:
            run.objective.teacher = teacher(run.cfg, run.tokenizer, run.device, lambda *_: None)

    def loader(self, cfg: Config, data, split: str, batch_size: int, **kw):
        """SeededChatLoader: conversations, packed per sft.packing, each training batch seeded."""
        return SeededChatLoader(data.split(split), cfg.seq_len, batch_size, packing=cfg.sft.packing, **kw)


def teacher(cfg: Config, tokenizer, device: torch.device, say):
    """gkd.teacher as ChatBatch -> logits (B, T, V): a frozen model in eval mode, given the batch's
    positions and segments (packed rows: attention stays within a conversation, as the student's)."""
    from lmforge.finetune.teacher import load_teacher

    model = load_teacher(cfg.gkd.teacher, cfg.gkd.teacher_weights, cfg.model.vocab_size, tokenizer, device,
                         say, key="gkd.teacher")
    dev = device_of(model)

    def logits(batch: ChatBatch) -> torch.Tensor:
        kw = {} if batch.segment_ids is None else {"position_ids": batch.position_ids.to(dev),
                                                   "segment_ids": batch.segment_ids.to(dev)}
        with torch.no_grad():
            return logits_of(model(batch.input_ids.to(dev), **kw))

    return logits


class SeededChatLoader(ChatLoader):
    """ChatLoader whose training batches (`GKDBatch`) carry a seed drawn from (seed, rank, epoch,
    position), which fixes the batch's on-policy draw and samples: a resumed run, whose loader resumes at
    the same position, makes the same. Evaluation batches are plain ChatBatches (never sampled)."""

    def next_batch(self) -> GKDBatch:
        key = [self.seed, self.rank, self.sampler.epoch, self.sampler.cursor]
        batch = super().next_batch()
        seed = int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0] >> np.uint64(1))
        return GKDBatch(**{f: getattr(batch, f) for f in ChatBatch.__dataclass_fields__}, seed=seed)


class OnPolicy:
    """(ChatBatch, seed) -> the batch's conversations as prompt + a completion the student samples, or
    None when no conversation has a completion. A conversation's prompt is its tokens before its last run
    of loss targets (its last assistant turn, as TRL's prompt / completion split has it); the completion
    is sampled at gkd.temperature from the current weights (eval mode, KV cache, adapters merged and
    restored exactly), ends at the template's end-of-turn token or EOS (included: the student learns to
    stop) or at gkd.max_new_tokens / train.seq_len. The rows are unpacked and right-padded."""

    def __init__(self, model: nn.Module, cfg: Config, data) -> None:
        from lmforge.data.chat_template import stop_ids

        self.model, self.cfg, self.seq_len = model, cfg.gkd, cfg.seq_len
        self.stops, self.pad_id = frozenset(stop_ids(data.template, data.tokenizer)), data.tokenizer.eos_id

    @torch.no_grad()
    def __call__(self, batch: ChatBatch, seed: int) -> ChatBatch | None:
        from lmforge.finetune.lora import merged_for_inference
        from lmforge.models.generation import sample_replies

        prompts = prompts_of(batch)
        if not prompts:
            return None
        device = device_of(self.model)
        room = min(self.seq_len, self.model.cfg.max_seq_len) - max(map(len, prompts))
        gen = torch.Generator(device=device).manual_seed(seed)
        with merged_for_inference(self.model):
            completions = sample_replies(self.model, prompts, min(self.cfg.max_new_tokens, room), self.stops,
                                         temperature=self.cfg.temperature, generator=gen, device=device)
        return rows(prompts, completions, self.pad_id, batch.input_ids.device)


def prompts_of(batch: ChatBatch) -> list[list[int]]:
    """Each conversation's tokens up to (and including) the position that predicts the first token of its
    last run of targets; conversations without a target are left out."""
    ids, targets = batch.input_ids.cpu(), batch.targets.cpu()
    segments = None if batch.segment_ids is None else batch.segment_ids.cpu()
    prompts = []
    for r in range(ids.size(0)):
        spans = [torch.arange(ids.size(1))] if segments is None else \
            [(segments[r] == s).nonzero().squeeze(1) for s in segments[r].unique().tolist() if s >= 0]
        for pos in spans:
            at = pos[targets[r, pos] != IGNORE_INDEX].tolist()
            if not at:
                continue
            start = len(at) - 1
            while start > 0 and at[start - 1] == at[start] - 1:
                start -= 1
            prompts.append(ids[r, int(pos[0]) : at[start] + 1].tolist())
    return prompts


def rows(prompts: list[list[int]], completions: list[list[int]], pad_id: int,
         device: torch.device) -> ChatBatch:
    """Right-padded rows of prompt + completion, with the next token as target on the positions that
    predict a completion token (IGNORE_INDEX elsewhere), and their target count."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    targets = torch.full((len(prompts), width), IGNORE_INDEX, dtype=torch.long)
    real = 0
    for r, (p, c) in enumerate(zip(prompts, completions)):
        ids[r, : len(p) + len(c)] = torch.as_tensor(p + c)
        if c:
            targets[r, len(p) - 1 : len(p) + len(c) - 1] = torch.as_tensor(c)
        real += len(p) + len(c)
    n = sum(len(c) for c in completions)
    return ChatBatch(ids.to(device), targets.to(device), real_tokens=real, n_targets=n)
