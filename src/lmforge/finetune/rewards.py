"""Programmatic rewards for RL: functions of a completion's text and its prompt record's info.

  exact_match  1 when the reply's answer equals the record's 'answer': the shipped task family's
               checker when the record names its 'task' (instruct_tasks.score: the answer is the
               reply's first line, put in the family's canonical form), else the first line, stripped,
               equal to the answer, stripped.
  format       1 when the reply ended its turn (a stop token, not the length limit) and is one
               non-empty line: the shape every shipped task asks for.
  reward_model a reward model's score of prompt + reply (`lmforge reward`; computed by the rollout on
               the token ids, so the reward model must share the policy's tokenizer).

`score_replies` sums the configured functions with their weights (TRL's reward_funcs and
reward_weights, summed before the advantages are taken).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lmforge.data.instruct_tasks import extract_answer, score

__all__ = ["REWARDS", "exact_match", "format_reward", "score_replies"]


def exact_match(text: str, info: dict, stopped: bool) -> float:  # noqa: ARG001
    answer = str(info.get("answer", ""))
    if info.get("task") is not None:
        return float(score(str(info["task"]), answer, text))
    return float(extract_answer(text) == answer.strip())


def format_reward(text: str, info: dict, stopped: bool) -> float:  # noqa: ARG001
    body = text.strip()
    return float(stopped and bool(body) and "\n" not in body)


REWARDS: dict[str, Callable[[str, dict, bool], float]] = {"exact_match": exact_match, "format": format_reward}


def score_replies(weights: dict[str, float], texts: Sequence[str], infos: Sequence[dict],
                  stopped: Sequence[bool]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(weighted sum (N,), each function's unweighted reward (N,)) of the replies `texts`, over the
    text rewards of `weights` (a reward model's score is added by the rollout)."""
    parts = {name: torch.tensor([REWARDS[name](t, i, s) for t, i, s in zip(texts, infos, stopped)],
                                dtype=torch.float32)
             for name in weights if name in REWARDS}
    if not parts:
        n = len(texts)
        return torch.zeros(n), {}
    total = sum(weights[name] * part for name, part in parts.items())
    return total, parts
