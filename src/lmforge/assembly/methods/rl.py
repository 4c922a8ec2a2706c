"""RL setup (objective rl, over prompts): the rollout that samples completions from the trained model
and scores them (rewards, a reward model), the reference model of its KL term, the prompt loaders."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lmforge.assembly.methods.base import MethodSetup, SetupContext
from lmforge.assembly.methods.reference import device_of, eval_reference, reference
from lmforge.config.methods import method_facts
from lmforge.config.schema import Config
from lmforge.data import data_dir
from lmforge.engine.objectives.policy_gradient import PolicyGradient
from lmforge.errors import ConfigError, DataError
from lmforge.finetune.setup import load_finetuned


class RLSetup(MethodSetup):
    names = (PolicyGradient.name,)

    def check_inputs(self, cfg: Config) -> None:
        if cfg.rl.reward_model:
            reward_model_config(cfg.rl.reward_model)

    def attach(self, objective, ctx: SetupContext):
        if not isinstance(objective, PolicyGradient):
            return None
        cfg, dims = ctx.cfg, ctx.dims
        if objective.rollout is None:
            if dims.fsdp or dims.tp > 1 or dims.pp > 1:
                raise ConfigError("objective rl samples completions with the whole model on each rank: one "
                                  "process or DDP (parallel.dp_replicate), not FSDP, tensor or pipeline "
                                  "parallelism")
            ref = reference(ctx.model, cfg, dims, ctx.device, ctx.data, ctx.source_vocab, ctx.say,
                            "rl.beta=0") if cfg.rl.beta > 0 else None
            objective.rollout = rollout(ctx.model, cfg, ctx.data, ref)
        if objective.replay is not None:
            objective.replay.place(dims.dp_rank, dims.dp_size)  # a resume mid-batch must find this layout
        return None

    def attach_eval(self, run, data) -> None:
        if isinstance(run.objective, PolicyGradient):  # the reference gives the KL the validation logged
            ref = eval_reference(run.model, run.cfg, run.device, data) if run.cfg.rl.beta > 0 else None
            run.objective.rollout = rollout(run.model, run.cfg, data, ref)

    def loader(self, cfg: Config, data, split: str, batch_size: int, **kw):
        """PromptLoader: batch_size prompts and the records' answers their rewards check against."""
        from lmforge.data.chat_loader import PromptLoader

        info = data.info(split)
        if info is None:
            raise DataError(f"{data.dir} holds RL prompts without their answers; prepare the data again "
                            "(delete the dir)")
        return PromptLoader(data.split(split), info, cfg.seq_len, batch_size, **kw)


def rollout(model: nn.Module, cfg: Config, data, reference):
    """The rl objective's rollout: completions sampled from `model` itself (the trained weights), ended
    at the template's end-of-turn token or EOS, scored by cfg.rl.rewards."""
    from lmforge.data.chat_template import stop_ids
    from lmforge.finetune.rollout import Rollout

    stops = stop_ids(data.template, data.tokenizer)
    scorer = reward_model(cfg, data, device_of(model)) if cfg.rl.reward_model else None
    return Rollout(model, data.tokenizer, stops, cfg.rl, cfg.seq_len, reference=reference,
                   pad_id=data.tokenizer.eos_id, reward_model=scorer)


def reward_model_config(path: str) -> tuple[Config, Path]:
    """(config, weights dir) of rl.reward_model, refused unless it is an `lmforge reward` run."""
    from lmforge.checkpoint.runs import run_config

    rm_cfg, source = run_config(path)
    if method_facts(rm_cfg).scalar_head != "score" or not rm_cfg.model.score_head:
        raise ConfigError(f"rl.reward_model={path!r} is not a reward model (objective "
                          f"{rm_cfg.objective.name}); train one with `lmforge reward`")
    return rm_cfg, source


def reward_model(cfg: Config, data, device: torch.device):
    """rl.reward_model as (ids, targets) -> score at each row's last token: an `lmforge reward` run,
    loaded frozen, which must share the policy's tokenizer (it scores the same token ids)."""
    import hashlib

    from lmforge.data.sft import TOKENIZER_FILE, load_prepared_sft
    from lmforge.engine.objectives.reward import sequence_scores

    rm_cfg, source = reward_model_config(cfg.rl.reward_model)
    rm_data = load_prepared_sft(data_dir(rm_cfg))
    digest = lambda d: hashlib.sha256((d.dir / TOKENIZER_FILE).read_bytes()).hexdigest()  # noqa: E731
    if digest(rm_data) != digest(data):
        raise ConfigError(f"rl.reward_model={cfg.rl.reward_model!r} uses another tokenizer than the policy "
                          "(its scores are of token ids): train the reward model from the same base model "
                          "and chat template")
    rm, _ = load_finetuned(rm_cfg, source, "model", device)
    rm.requires_grad_(False).eval()
    return lambda ids, targets: sequence_scores(rm, ids, targets)
