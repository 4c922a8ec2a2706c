"""Objectives: what a training step minimises. `build_objective(cfg)` picks one from the config."""

from __future__ import annotations

from lmforge.config.schema import Config
from lmforge.engine.objectives.base import Objective, ObjectiveModule, ObjectiveOutput, TokenObjective
from lmforge.engine.objectives.causal_lm import CausalLM
from lmforge.engine.objectives.classify import Classify
from lmforge.engine.objectives.distill import Distill, TopK
from lmforge.engine.objectives.gkd import GKD
from lmforge.engine.objectives.glm import GLM
from lmforge.engine.objectives.mlm import MaskedLM
from lmforge.engine.objectives.policy_gradient import PolicyGradient
from lmforge.engine.objectives.preference import Preference
from lmforge.engine.objectives.prefix_lm import PrefixLM
from lmforge.engine.objectives.qa import QA
from lmforge.engine.objectives.reward import RewardModel
from lmforge.engine.objectives.seq2seq import Seq2Seq
from lmforge.engine.objectives.sft import SFT
from lmforge.engine.objectives.span_corruption import SpanCorruption
from lmforge.engine.objectives.token_classify import TokenClassify

OBJECTIVES: dict[str, type[Objective]] = {CausalLM.name: CausalLM, SFT.name: SFT, Preference.name: Preference,
                                          PolicyGradient.name: PolicyGradient, RewardModel.name: RewardModel,
                                          Distill.name: Distill, MaskedLM.name: MaskedLM,
                                          GKD.name: GKD, Classify.name: Classify, PrefixLM.name: PrefixLM,
                                          GLM.name: GLM, TokenClassify.name: TokenClassify, QA.name: QA,
                                          SpanCorruption.name: SpanCorruption, Seq2Seq.name: Seq2Seq}


def build_objective(cfg: Config) -> Objective:
    """The objective `cfg.objective.name` names, with its settings."""
    return OBJECTIVES[cfg.objective.name].from_config(cfg)


__all__ = ["OBJECTIVES", "SFT", "CausalLM", "Distill", "GKD", "MaskedLM", "TopK", "PolicyGradient",
           "Preference", "RewardModel", "Objective", "ObjectiveModule", "ObjectiveOutput", "TokenObjective",
           "build_objective", "Classify", "PrefixLM", "GLM", "TokenClassify", "QA", "SpanCorruption",
           "Seq2Seq"]
