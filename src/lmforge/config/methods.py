"""The `objective` section: one class per training method, chosen by `objective.name` (a discriminated
union, as `optim` is), each holding its method's static facts so that nothing else has to name a method.

    facts = method_facts(cfg)        # what the run's method reads, whether its loss has a perplexity, ...
    if facts.chat: ...               # chat data, a template, fine-tuning a given model
    facts.token_loss                 # exp(loss) is a perplexity, bits per byte apply (console and eval)
    facts.extra_models               # ("reference",), ("teacher",), ("reference", "reward"), ...

A method's own settings sit in its section of the tree (`sft`, `preference`, `rl`, `distill`, `mlm`):
`settings_section` names it, `data_section` the section its data is set in (`data` for token data).
Facts that depend on those settings (KTO reads unpaired records; rl needs a reference only with a KL
term) are computed from the whole config by `facts(cfg)`.

A new method is a class here (and in METHOD_CONFIGS and the union below), its objective in
engine/objectives and its setup in assembly/methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field

from lmforge.config.section import Section

if TYPE_CHECKING:
    from lmforge.config.schema import Config

DataKind = Literal["tokens", "chat", "pairs", "unpaired", "prompts"]
ExtraModel = Literal["reference", "teacher", "reward"]

# Preference losses with no reference model (the engine's preference_loss reads this set too).
REFERENCE_FREE = frozenset({"simpo", "orpo"})


@dataclass(frozen=True)
class MethodFacts:
    """What one run's training method is, as every other part of lmforge asks it."""

    name: str  # objective.name
    data: DataKind  # tokens (data.sources), chat conversations, preference pairs, unpaired records, prompts
    token_loss: bool  # the loss is a mean cross-entropy over tokens: perplexity and bits per byte apply
    data_section: str  # the config section its training data is set in (data, sft, preference, rl)
    settings_section: str | None  # the config section of its own settings (None: it has none)
    extra_models: tuple[ExtraModel, ...] = ()  # models it needs beside the trained one
    scalar_head: Literal["score", "value"] | None = None  # a head it adds to the model and trains
    batch_rows: int = 1  # sequences per example of a batch (a pair: 2)

    @property
    def chat(self) -> bool:
        """Chat data (a template), fine-tuning a given model; the vocabulary may grow for the template."""
        return self.data != "tokens"

    @property
    def unit(self) -> str:
        """What the evaluated loss is an average over."""
        return {"pairs": "pairs", "unpaired": "pairs", "prompts": "loss targets"}.get(self.data, "tokens")

    @property
    def data_keys(self) -> tuple[str, str]:
        """(train, held-out) keys of its data, for messages."""
        if self.data_section == "data":
            return "data.sources", "data.val_sources"
        return f"{self.data_section}.data", f"{self.data_section}.val_data"


class _Method(Section):
    name: str = Field(description="The training method (objective.name).")
    data: ClassVar[DataKind] = "tokens"
    token_loss: ClassVar[bool] = False
    data_section: ClassVar[str] = "data"
    settings_section: ClassVar[str | None] = None
    encoder: ClassVar[bool] = False  # it trains an encoder (model.arch=encoder); only such methods do

    @classmethod
    def facts(cls, cfg: Config) -> MethodFacts:
        return MethodFacts(cls.model_fields["name"].default, cls.data, cls.token_loss, cls.data_section,
                           cls.settings_section)

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> _Method:
        """A copy; one that names another method (`update={"name": "sft"}`, as the verb of a method does)
        is that method's section, validated, so that its class and its facts agree with its name."""
        if update and update.get("name", self.name) != self.name:
            return objective_config(**{**self.model_dump(), **update})
        return super().model_copy(update=update, deep=deep)


class CausalLMObjective(_Method):
    name: Literal["causal_lm"] = Field("causal_lm", description="Next-token prediction over every target "
                                       "token (pretraining) on the data section's documents.")
    token_loss: ClassVar[bool] = True


class SFTObjective(_Method):
    name: Literal["sft"] = Field("sft", description="Supervised fine-tuning on the chat data of the sft "
                                 "section (loss on the tokens sft.loss_on picks).")
    data: ClassVar[DataKind] = "chat"
    token_loss: ClassVar[bool] = True
    data_section: ClassVar[str] = "sft"
    settings_section: ClassVar[str | None] = "sft"


class DPOObjective(_Method):
    name: Literal["dpo"] = Field("dpo", description="Preference optimisation on the pairs of the preference "
                                 "section (the DPO family, SimPO, ORPO, KTO: preference.loss).")
    data: ClassVar[DataKind] = "pairs"
    data_section: ClassVar[str] = "preference"
    settings_section: ClassVar[str | None] = "preference"

    @classmethod
    def facts(cls, cfg: Config) -> MethodFacts:
        loss = cfg.preference.loss
        return MethodFacts("dpo", "unpaired" if loss == "kto" else "pairs", False, "preference", "preference",
                           () if loss in REFERENCE_FREE else ("reference",), batch_rows=2)


class RewardObjective(_Method):
    name: Literal["reward"] = Field("reward", description="A reward model (a scalar score head, "
                                    "Bradley-Terry loss) on the pairs of the preference section.")
    data: ClassVar[DataKind] = "pairs"
    data_section: ClassVar[str] = "preference"
    settings_section: ClassVar[str | None] = "preference"

    @classmethod
    def facts(cls, cfg: Config) -> MethodFacts:
        return MethodFacts("reward", "pairs", False, "preference", "preference", scalar_head="score",
                           batch_rows=2)


class RLObjective(_Method):
    name: Literal["rl"] = Field("rl", description="Reinforcement learning on sampled completions of the rl "
                                "section's prompts, scored by rewards (GRPO, RLOO, PPO: rl.algorithm).")
    data: ClassVar[DataKind] = "prompts"
    data_section: ClassVar[str] = "rl"
    settings_section: ClassVar[str | None] = "rl"

    @classmethod
    def facts(cls, cfg: Config) -> MethodFacts:
        rl = cfg.rl
        extra = (("reference",) if rl.beta > 0 else ()) + (("reward",) if rl.reward_model else ())
        return MethodFacts("rl", "prompts", False, "rl", "rl", extra,
                           scalar_head="value" if rl.algorithm == "ppo" else None)


class DistillObjective(_Method):
    name: Literal["distill"] = Field("distill", description="Knowledge distillation from the teacher of the "
                                     "distill section on the pretraining data (next-token targets).")
    # its validation loss reports the data's cross-entropy (the objective's `ce` metric): a perplexity
    token_loss: ClassVar[bool] = True
    settings_section: ClassVar[str | None] = "distill"

    @classmethod
    def facts(cls, cfg: Config) -> MethodFacts:
        return MethodFacts("distill", "tokens", True, "data", "distill", ("teacher",))


class MLMObjective(_Method):
    name: Literal["mlm"] = Field("mlm", description="Masked language modelling of an encoder "
                                 "(model.arch=encoder) on the pretraining data (the mlm section).")
    settings_section: ClassVar[str | None] = "mlm"
    encoder: ClassVar[bool] = True


METHOD_CONFIGS: dict[str, type[_Method]] = {
    "causal_lm": CausalLMObjective, "sft": SFTObjective, "dpo": DPOObjective, "reward": RewardObjective,
    "rl": RLObjective, "distill": DistillObjective, "mlm": MLMObjective,
}


DEFAULT_METHOD = CausalLMObjective.model_fields["name"].default  # pretraining: what a run does unless told


def default_method(arch: str) -> str:
    """The method a model of `arch` trains (and is evaluated) with when the config names none: an encoder's
    is its masked LM, a decoder's next-token pretraining."""
    return next((n for n, c in METHOD_CONFIGS.items() if c.encoder), DEFAULT_METHOD) if arch == "encoder" \
        else DEFAULT_METHOD


def _before(value: Any) -> Any:
    """The default method when the section names none, before the union picks a class."""
    if isinstance(value, dict) and "name" not in value:
        value = {**value, "name": DEFAULT_METHOD}
    return value


ObjectiveConfig = Annotated[
    CausalLMObjective | SFTObjective | DPOObjective | RewardObjective | RLObjective | DistillObjective
    | MLMObjective,
    Field(discriminator="name"),
    BeforeValidator(_before),
]


def check_arch(name: str, arch: str) -> None:
    """Refuse a method with a model it cannot train: encoder methods train encoders, and only they do."""
    if METHOD_CONFIGS[name].encoder != (arch == "encoder"):
        enc = default_method("encoder")
        raise ValueError(f"objective.name={name} does not fit model.arch={arch}: an encoder trains with "
                         f"objective {enc} and objective {enc} needs model.arch=encoder")


def method_facts(cfg: Config) -> MethodFacts:
    """The facts of the run's method. Looked up by `objective.name`, so that a section copied with another
    name (`cfg.objective.model_copy(update={"name": ...})`) still answers for the name it holds."""
    return METHOD_CONFIGS[cfg.objective.name].facts(cfg)


def objective_config(**fields: Any) -> _Method:
    """The `objective` section from keyword fields, validated as the config file's section is:
    objective_config(name="dpo")."""
    from pydantic import TypeAdapter

    return TypeAdapter(ObjectiveConfig).validate_python(fields)
