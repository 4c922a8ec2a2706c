"""One setup per training-method family (base.py: the interface `build_run` calls). A new family is a
module here with a MethodSetup subclass, listed in SETUPS; its facts are in config/methods.py."""

from __future__ import annotations

from lmforge.assembly.methods.base import MethodSetup, SetupContext
from lmforge.assembly.methods.classify import ClassifySetup
from lmforge.assembly.methods.distill import DistillSetup
from lmforge.assembly.methods.gkd import GKDSetup
from lmforge.assembly.methods.glm import GLMSetup
from lmforge.assembly.methods.mlm import MLMSetup
from lmforge.assembly.methods.preference import PreferenceSetup
from lmforge.assembly.methods.prefix_lm import PrefixLMSetup
from lmforge.assembly.methods.qa import QASetup
from lmforge.assembly.methods.rl import RLSetup
from lmforge.assembly.methods.seq2seq import Seq2SeqSetup
from lmforge.assembly.methods.sft import SFTSetup
from lmforge.assembly.methods.span_corruption import SpanCorruptionSetup
from lmforge.assembly.methods.token_classify import TokenClassifySetup
from lmforge.assembly.methods.tokens import CausalLMSetup
from lmforge.config.methods import METHOD_CONFIGS
from lmforge.config.schema import Config

SETUPS: tuple[MethodSetup, ...] = (CausalLMSetup(), SFTSetup(), PreferenceSetup(), RLSetup(), DistillSetup(),
                                   MLMSetup(), GKDSetup(), ClassifySetup(), PrefixLMSetup(),
                                   GLMSetup(), TokenClassifySetup(), QASetup(), SpanCorruptionSetup(),
                                   Seq2SeqSetup())
SETUP_OF: dict[str, MethodSetup] = {name: setup for setup in SETUPS for name in setup.names}
assert set(SETUP_OF) == set(METHOD_CONFIGS), "every method in the config union has a setup"


def method_setup(cfg: Config) -> MethodSetup:
    """The setup of the run's method (objective.name)."""
    return SETUP_OF[cfg.objective.name]


__all__ = ["SETUPS", "MethodSetup", "SetupContext", "method_setup"]
