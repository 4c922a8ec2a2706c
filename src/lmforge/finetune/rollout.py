"""RL rollouts: prompts -> sampled completions -> rewards -> advantages, the `RolloutBatch` the rl
objective trains on.

For each prompt, group_size completions are sampled with the current weights (eval mode, KV cache,
one batch for the whole micro-batch; `models.generation.sample_replies`), at rl.temperature / top_k /
top_p, from a generator seeded by the batch's seed (so a resumed run samples the same completions).
A completion ends at the template's end-of-turn token or EOS, which it includes (the policy learns
to stop), or at rl.max_new_tokens. Its text (stop token excluded) is scored by the rewards of
finetune/rewards.py; advantages are group-relative (engine/policy_loss.py). With rl.beta > 0 the
reference model's per-token log-probs come along (grpo: the KL term of the loss; rloo: the KL
penalty subtracted from each reward, with the sampling policy's log-probs, as TRL's RLOOTrainer).
With rl.iterations > 1 the batch trains several updates, so the sampling policy's log-probs are
taken now (a no-grad forward over prompt + completion, as TRL does for num_iterations > 1): the
later updates clip their ratio against them. PPO's batch always has them (and the values).

A greedy batch (a validation pass) gets one completion per prompt at temperature 0: its rewards
are the held-out exact match the run reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lmforge.config.schema import RLConfig
from lmforge.data.batch import IGNORE_INDEX, PromptBatch, RolloutBatch
from lmforge.data.tokenizer import Tokenizer
from lmforge.engine.loss import logits_of
from lmforge.engine.policy_loss import gae, group_advantages, masked_whiten, token_rewards
from lmforge.engine.preference_loss import token_logps
from lmforge.finetune.lora import merged_for_inference
from lmforge.finetune.rewards import score_replies
from lmforge.models.generation import sample_replies

TokenLogps = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, targets) -> (N, T) log-probs
Scores = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, targets) -> (N,) reward-model scores


class Rollout:
    """PromptBatch -> RolloutBatch with `policy` (the model being trained, unwrapped)."""

    def __init__(self, policy: nn.Module, tokenizer: Tokenizer, stops: set[int], cfg: RLConfig, seq_len: int,
                 reference: TokenLogps | None = None, pad_id: int = 0,
                 reward_model: Scores | None = None) -> None:
        self.policy, self.tokenizer, self.stops, self.cfg = policy, tokenizer, frozenset(stops), cfg
        self.seq_len, self.reference, self.pad_id = seq_len, reference, pad_id
        self.reward_model = reward_model
        if ("reward_model" in cfg.rewards) != (reward_model is not None):
            raise ValueError("rewards.reward_model needs a reward model (and a reward model a weight)")

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def __call__(self, batch: PromptBatch) -> RolloutBatch:
        cfg, device = self.cfg, self.device
        group = 1 if batch.greedy else cfg.group_size
        prompts = [list(p) for p in batch.prompts for _ in range(group)]
        infos = [info for info in batch.info for _ in range(group)]
        room = min(self.seq_len, self.policy.cfg.max_seq_len) - max(map(len, prompts))
        gen = torch.Generator(device=device).manual_seed(batch.seed)
        with merged_for_inference(self.policy):  # adapters folded in while sampling, restored exactly
            completions = sample_replies(
                self.policy, prompts, min(cfg.max_new_tokens, room), self.stops,
                temperature=0.0 if batch.greedy else cfg.temperature, top_k=cfg.top_k,
                top_p=None if cfg.top_p >= 1.0 else cfg.top_p, generator=gen, device=device,
            )
        stopped = [bool(c) and c[-1] in self.stops for c in completions]
        texts = [self.tokenizer.decode(c[:-1] if s else c) for c, s in zip(completions, stopped)]
        rewards, parts = score_replies(cfg.rewards, texts, infos, stopped)
        ids, targets, real = _rows(prompts, completions, self.pad_id)
        ids, targets = ids.to(device), targets.to(device)
        rewards, parts = rewards.to(device), {k: v.to(device) for k, v in parts.items()}
        if self.reward_model is not None:
            with torch.no_grad():
                parts["reward_model"] = self.reward_model(ids, targets).detach().float()
            rewards = rewards + cfg.rewards["reward_model"] * parts["reward_model"]
        ref = old = None
        if cfg.beta > 0 and self.reference is not None:
            with torch.no_grad():
                ref = self.reference(ids, targets).detach()
        if cfg.algorithm == "ppo":
            return self._ppo(batch, ids, targets, rewards, parts, ref, group, real)
        scored = rewards
        rloo_kl = cfg.algorithm == "rloo" and ref is not None  # TRL: the KL penalty is part of the reward
        if rloo_kl or (cfg.iterations > 1 and not batch.greedy):
            with _sampling_mode(self.policy), torch.no_grad():
                old = token_logps(logits_of(self.policy(ids)), targets)
        if rloo_kl:
            scored = rewards - cfg.beta * (old - ref).sum(-1)
        advantages = group_advantages(scored, group, cfg.algorithm, cfg.reward_scaling)
        return RolloutBatch(ids, targets, advantages, rewards, group, old_logps=old, ref_logps=ref,
                            reward_parts=parts, real_tokens=real, iteration=0 if batch.greedy else 1)

    @torch.no_grad()
    def _ppo(self, batch: PromptBatch, ids: torch.Tensor, targets: torch.Tensor, rewards: torch.Tensor,
             parts: dict, ref: torch.Tensor | None, group: int, real: int) -> RolloutBatch:
        """PPO's batch: the sampling policy's log-probs and values (one forward, eval mode), per-token
        KL-penalty rewards with the score at the last token, GAE, advantages whitened over the batch."""
        cfg, policy = self.cfg, self.policy
        with _sampling_mode(policy):
            old, values = _policy_forward(policy, ids, targets)
        mask = targets != IGNORE_INDEX
        # values[t] is the value of the state that predicts token t + 1: the one the token's reward follows
        per_token = token_rewards(rewards, old, ref, mask, cfg.beta)
        advantages, returns = gae(per_token, values, mask, cfg.gamma, cfg.lam)
        if not batch.greedy:
            advantages = masked_whiten(advantages, mask)
        return RolloutBatch(ids, targets, advantages, rewards, group, old_logps=old, ref_logps=ref,
                            reward_parts=parts, real_tokens=real, old_values=values * mask, returns=returns,
                            iteration=0 if batch.greedy else 1)


@contextmanager
def _sampling_mode(policy: nn.Module) -> Iterator[None]:
    """The policy in eval mode (no dropout: the log-probs of the policy that sampled), then as it was."""
    was = policy.training
    policy.eval()
    try:
        yield
    finally:
        policy.train(was)


def _policy_forward(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token log-probs of the targets, the value head's value at every position) (N, T) of one
    forward: the hidden states feed both the output projection and `model.value`."""
    logits, hidden = model(ids, head=lambda h, w: (torch.nn.functional.linear(h, w), h))
    return token_logps(logits, targets), model.value(hidden).squeeze(-1).float()


def _rows(prompts: list[list[int]], completions: list[list[int]], pad_id: int
          ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Right-padded rows of prompt + completion and their targets: the next token on the positions
    that predict a completion token, IGNORE_INDEX elsewhere."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    targets = torch.full((len(prompts), width), IGNORE_INDEX, dtype=torch.long)
    real = 0
    for r, (p, c) in enumerate(zip(prompts, completions)):
        row = p + c
        ids[r, : len(row)] = torch.as_tensor(row)
        if c:
            targets[r, len(p) - 1 : len(row) - 1] = torch.as_tensor(c)
        real += len(row)
    return ids, targets, real
