"""Next-token pretraining: token data and its objective, nothing else to set up."""

from __future__ import annotations

from lmforge.assembly.methods.base import MethodSetup
from lmforge.engine.objectives.causal_lm import CausalLM


class CausalLMSetup(MethodSetup):
    names = (CausalLM.name,)
