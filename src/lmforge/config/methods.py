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

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

from pydantic import BeforeValidator, Field, field_validator, model_validator

from lmforge.config.distill import DistillConfig  # noqa: F401 - its section, re-exported
from lmforge.config.infill import GLM_TOKENS
from lmforge.config.section import Section

if TYPE_CHECKING:
    from lmforge.config.schema import Config

DataKind = Literal["tokens", "chat", "pairs", "unpaired", "prompts", "labelled", "tagged", "spans",
                   "text2text"]
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
    head_outputs: int = 1  # outputs of the scalar head (a classifier's: its number of labels)
    tokens: tuple[str, ...] = ()  # special tokens its data needs; `lmforge prepare` adds those missing
    # what the score head reads: a summary of the sequence, each token (a tagger), each token's start/end
    head_reads: Literal["sequence", "token", "span"] = "sequence"

    @property
    def chat(self) -> bool:
        """Chat data (a template), fine-tuning a given model; the vocabulary may grow for the template."""
        return self.data != "tokens"

    @property
    def unit(self) -> str:
        """What the evaluated loss is an average over."""
        return {"pairs": "pairs", "unpaired": "pairs", "prompts": "loss targets",
                "labelled": "examples", "tagged": "tagged tokens", "spans": "windows",
                "text2text": "target tokens"}.get(self.data,
                                                                                          "tokens")

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
    # it trains an encoder (model.arch=encoder) and only encoders; None: either kind of model
    encoder: ClassVar[bool | None] = False
    # it trains the encoder-decoder (model.arch=t5), and only it does (the t5 methods train nothing else)
    t5: ClassVar[bool] = False

    @model_validator(mode="wrap")
    @classmethod
    def _name_left_unset(cls, data: Any, handler: Any) -> Any:
        section = handler(data)
        if isinstance(data, _Unnamed):
            section.model_fields_set.discard("name")
        return section

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


class SpanCorruptionObjective(_Method):
    name: Literal["span_corruption"] = Field(
        "span_corruption", description="T5's span corruption of an encoder-decoder (model.arch=t5) on the "
        "pretraining data (the span_corruption section): spans replaced by sentinels in the encoder's "
        "input, the decoder predicting them.")
    token_loss: ClassVar[bool] = True
    settings_section: ClassVar[str | None] = "span_corruption"
    t5: ClassVar[bool] = True


class GKDObjective(_Method):
    name: Literal["gkd"] = Field("gkd", description="Generalized knowledge distillation on the chat data of "
                                 "the sft section: the student learns the gkd section's teacher on the "
                                 "completions, partly on its own samples (gkd.lmbda).")
    data: ClassVar[DataKind] = "chat"
    # The loss is a divergence, not a cross-entropy; the objective also reports the student's
    # cross-entropy of the completions (its `ce` metric), which validation prints as val_ppl.
    token_loss: ClassVar[bool] = True
    data_section: ClassVar[str] = "sft"
    settings_section: ClassVar[str | None] = "gkd"

    @classmethod
    def facts(cls, cfg: Config) -> MethodFacts:
        return MethodFacts("gkd", "chat", True, "sft", "gkd", ("teacher",))


class ClassifyObjective(_Method):
    name: Literal["classify"] = Field("classify", description="Sequence classification (or regression with "
                                      "classify.num_labels=1) of the labelled records of the classify "
                                      "section: a head of num_labels outputs on a decoder's last real "
                                      "token or an encoder's [CLS].")
    data: ClassVar[DataKind] = "labelled"
    encoder: ClassVar[bool | None] = None  # a decoder or an encoder
    data_section: ClassVar[str] = "classify"
    settings_section: ClassVar[str | None] = "classify"

    @classmethod
    def facts(cls, cfg: Config) -> MethodFacts:
        return MethodFacts("classify", "labelled", False, "classify", "classify", scalar_head="score",
                           head_outputs=cfg.classify.num_labels)


class PrefixLMObjective(_Method):
    name: Literal["prefix_lm"] = Field("prefix_lm", description="Prefix language modelling of a decoder on "
                                       "the pretraining data: each document's prefix attended both ways, "
                                       "its continuation predicted (the prefix_lm section).")
    # the loss is the continuation's cross-entropy: its perplexity and bits per byte
    token_loss: ClassVar[bool] = True
    settings_section: ClassVar[str | None] = "prefix_lm"


class GLMObjective(_Method):
    name: Literal["glm"] = Field("glm", description="GLM's autoregressive blank infilling of a decoder on "
                                 "the pretraining data: spans become [MASK] in a bidirectional part A and "
                                 "are predicted after it with 2-D positions (the glm section; needs "
                                 "model.block_position_embedding=true).")
    settings_section: ClassVar[str | None] = "glm"

    @classmethod
    def facts(cls, cfg: Config) -> MethodFacts:
        return MethodFacts("glm", "tokens", False, "data", "glm", tokens=GLM_TOKENS)


class TokenClassifyObjective(_Method):
    name: Literal["tag"] = Field(
        "tag", description="Token classification (NER-style tagging) of the tagged words of the "
        "token_classify section: a head of num_labels outputs on every token, the word's tag on its first "
        "sub-word token.")
    data: ClassVar[DataKind] = "tagged"
    encoder: ClassVar[bool | None] = None  # a decoder or an encoder
    data_section: ClassVar[str] = "token_classify"
    settings_section: ClassVar[str | None] = "token_classify"

    @classmethod
    def facts(cls, cfg: Config) -> MethodFacts:
        return MethodFacts("tag", "tagged", False, "token_classify", "token_classify",
                           scalar_head="score", head_outputs=cfg.token_classify.num_labels,
                           head_reads="token")


class QAObjective(_Method):
    name: Literal["qa"] = Field("qa", description="Extractive question answering on the SQuAD-like records "
                                "of the qa section: a start/end head on every token of question + context.")
    data: ClassVar[DataKind] = "spans"
    encoder: ClassVar[bool | None] = None  # a decoder or an encoder
    data_section: ClassVar[str] = "qa"
    settings_section: ClassVar[str | None] = "qa"

    @classmethod
    def facts(cls, cfg: Config) -> MethodFacts:
        return MethodFacts("qa", "spans", False, "qa", "qa", scalar_head="score", head_outputs=2,
                           head_reads="span")


class Seq2SeqObjective(_Method):
    name: Literal["seq2seq"] = Field("seq2seq", description="Sequence-to-sequence fine-tuning of an encoder-"
                                     "decoder (model.arch=t5; `lmforge sft` trains it there) on the seq2seq "
                                     "section's input -> target records: loss on the target tokens.")
    data: ClassVar[DataKind] = "text2text"
    token_loss: ClassVar[bool] = True
    data_section: ClassVar[str] = "seq2seq"
    settings_section: ClassVar[str | None] = "seq2seq"
    t5: ClassVar[bool] = True


METHOD_CONFIGS: dict[str, type[_Method]] = {
    "causal_lm": CausalLMObjective, "sft": SFTObjective, "dpo": DPOObjective, "reward": RewardObjective,
    "rl": RLObjective, "distill": DistillObjective, "mlm": MLMObjective, "gkd": GKDObjective,
    "classify": ClassifyObjective, "prefix_lm": PrefixLMObjective, "glm": GLMObjective,
    "tag": TokenClassifyObjective, "qa": QAObjective,
    "span_corruption": SpanCorruptionObjective, "seq2seq": Seq2SeqObjective,  # span_corruption: T5's default
}


DEFAULT_METHOD = CausalLMObjective.model_fields["name"].default  # pretraining: what a run does unless told


def default_method(arch: str) -> str:
    """The method a model of `arch` trains (and is evaluated) with when the config names none: an encoder's
    is its masked LM, a decoder's next-token pretraining."""
    if arch == "t5":
        return next(n for n, c in METHOD_CONFIGS.items() if c.t5)
    if arch != "encoder":
        return DEFAULT_METHOD
    return next((n for n, c in METHOD_CONFIGS.items() if c.encoder is True), DEFAULT_METHOD)


class _Unnamed(dict):
    """A section that named no method, given the default's name so that the union can pick its class;
    the name stays unset in the section (`model_fields_set`), as the user left it."""


def _before(value: Any) -> Any:
    """The default method when the section names none, before the union picks a class."""
    if isinstance(value, dict) and "name" not in value:
        value = _Unnamed({**value, "name": DEFAULT_METHOD})
    return value


ObjectiveConfig = Annotated[
    Union[tuple(METHOD_CONFIGS.values())],  # noqa: UP007 - built from the registry: one place lists methods
    Field(discriminator="name"),
    BeforeValidator(_before),
]


def check_arch(name: str, arch: str) -> None:
    """Refuse a method with a model it cannot train: encoder methods train encoders, and only they do."""
    if METHOD_CONFIGS[name].t5 != (arch == "t5"):
        t5 = " or ".join(n for n, c in METHOD_CONFIGS.items() if c.t5)
        raise ValueError(f"objective.name={name} does not fit model.arch={arch}: an encoder-decoder (t5) "
                         f"trains with objective {t5}, and they need model.arch=t5")
    encoder = METHOD_CONFIGS[name].encoder
    if encoder is not None and encoder != (arch == "encoder"):
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


# -- the methods' own settings sections ----------------------------------------------------------------
class GKDConfig(Section):
    """Generalized knowledge distillation (objective gkd; Agarwal et al. 2024, TRL's GKDTrainer) on the
    chat data of the sft section: the teacher, the divergence and how often the student's own samples
    replace the data's completions."""

    teacher: str | None = Field(
        None, description="The teacher: a run dir, checkpoint dir or Hugging Face dir whose tokenizer is the "
        "student's (the chat template's tokens included); required by objective gkd."
    )
    teacher_weights: Literal["model", "ema", "swa"] = Field(
        "model", description="The teacher run's trained weights or their EMA / SWA average."
    )
    beta: float = Field(
        0.5, ge=0.0, le=1.0, description="Interpolation of the generalised Jensen-Shannon divergence: 0 is "
        "the forward KL(teacher || student), 1 the reverse KL(student || teacher) (TRL's convention)."
    )
    temperature: float = Field(
        0.9, gt=0.0, le=100.0, description="Both distributions of the divergence are of logits / "
        "temperature, and the student samples its on-policy completions at it."
    )
    lmbda: float = Field(
        0.5, ge=0.0, le=1.0, description="Probability that a training micro-batch's completions are sampled "
        "from the student itself (on-policy) instead of taken from the data (0: never, 1: always)."
    )
    max_new_tokens: int = Field(
        128, ge=1, le=4096, description="Longest on-policy completion (also bounded by train.seq_len)."
    )


class SFTConfig(Section):
    """Supervised fine-tuning data: conversations, their chat template, which tokens carry the loss."""

    data: list[str] = Field(
        default_factory=list, description="Chat data: .jsonl / .parquet files, folders of them, or a saved "
        "`datasets` dir (messages, prompt/completion, Alpaca or ShareGPT records; messages records may use "
        "tools: 'tools', assistant 'tool_calls', role 'tool')."
    )
    val_data: list[str] = Field(
        default_factory=list, description="Held-out chat data (empty: sft.val_fraction of sft.data)."
    )
    val_fraction: float = Field(
        0.05, ge=0.0, lt=1.0, description="Fraction of the conversations held out for validation."
    )
    format: Literal["auto", "messages", "prompt_completion", "alpaca", "sharegpt"] = Field(
        "auto", description="Record shape (auto: told apart record by record)."
    )
    template: str = Field(
        "auto", description="Chat template: auto (the tokenizer's own from tokenizer_config.json, else "
        "chatml), chatml (lmforge's, adds <|im_start|>/<|im_end|> to the tokenizer), or a .jinja file."
    )
    loss_on: Literal["assistant", "last", "all"] = Field(
        "assistant", description="Tokens that carry the loss: every assistant turn (for prompt/completion "
        "records, the completion only), the last assistant turn, or every token."
    )
    packing: bool = Field(
        True, description="Pack several conversations per sequence (best-fit decreasing; attention never "
        "crosses a conversation, positions restart); false: one per sequence, padded."
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="A conversation longer than train.seq_len: keep its start, or drop it."
    )
    on_bad_record: Literal["skip", "fail"] = Field(
        "skip", description="A malformed record: skip and count it, or stop with its file and line."
    )
    template_kwargs: dict[str, str | bool | int | float | None] = Field(
        default_factory=dict, description="Extra variables the chat template is rendered with, as "
        "transformers' apply_chat_template(**kwargs) passes them (Qwen3: {enable_thinking: false}); "
        "honoured by sft, generate --chat and serve."
    )

    @field_validator("template_kwargs", mode="before")
    @classmethod
    def _simple_template_kwargs(cls, v: Any) -> Any:
        # One clear message rather than one per member of the value union.
        if not isinstance(v, dict):
            raise ValueError(f"must be a mapping of variable names to values, got {type(v).__name__}")
        for name, value in v.items():
            if value is not None and not isinstance(value, (str, bool, int, float)):
                raise ValueError(f"{name!r} is {type(value).__name__}; a template variable here is a string, "
                                 "number, boolean or null")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name!r} is {value}; a number here must be a finite number")
        return v

    @field_validator("template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, v: dict) -> dict:
        reserved = {"messages", "add_generation_prompt", "range", "tools"}  # tools: each record's own
        for name in v:
            if not name.isidentifier() or name in reserved or name.startswith("_"):
                raise ValueError(f"sft.template_kwargs has {name!r}, which cannot be a template variable: "
                                 "give identifiers other than messages, add_generation_prompt, range, tools "
                                 "(a record's own 'tools') and names starting with _")
        return v


class PreferenceConfig(Section):
    """Preference optimisation (objective dpo): the pairs and the loss. The chat template, the record
    checks and what happens to sequences longer than train.seq_len are the sft section's settings."""

    data: list[str] = Field(
        default_factory=list, description="Preference pairs: .jsonl / .parquet files, folders of them or a "
        "saved `datasets` dir, in TRL's shapes: prompt/chosen/rejected as strings or message lists, or "
        "chosen/rejected whole conversations sharing their prompt (`lmforge tasks --pairs` writes some)."
    )
    val_data: list[str] = Field(
        default_factory=list, description="Held-out pairs (empty: preference.val_fraction of the data)."
    )
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Fraction of the pairs held out.")
    loss: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo", "kto"] = Field(
        "sigmoid", description="sigmoid: DPO (conservative DPO with label_smoothing > 0); ipo; hinge (SLiC); "
        "robust: rDPO; simpo and orpo need no reference model; kto: KTO on unpaired records (prompt, "
        "completion, label: `lmforge tasks --unpaired` writes some). The formulas are TRL's."
    )
    precompute_reference: bool = Field(
        False, description="Compute the reference model's log-probs of every pair once before training (and "
        "again on resume), then free the reference: full fine-tuning keeps no frozen copy in memory while it "
        "trains, LoRA skips a forward per step. Not with loss kto (its reference point pairs examples of a "
        "batch)."
    )
    desirable_weight: float = Field(1.0, gt=0.0, description="KTO: weight of the desirable examples' loss.")
    undesirable_weight: float = Field(1.0, gt=0.0, description="KTO: weight of the undesirable examples' "
                                      "loss (TRL: keep desirable_weight x #desirable / (undesirable_weight x "
                                      "#undesirable) within [1, 4/3]).")
    beta: float = Field(0.1, gt=0.0, description="Strength of the KL tie to the reference (DPO's beta; IPO's "
                        "tau; SimPO's and ORPO's beta / lambda).")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="Assumed fraction of flipped labels "
                                   "(sigmoid: conservative DPO; robust; simpo).")
    simpo_gamma: float = Field(0.5, ge=0.0, description="SimPO's target reward margin.")
    sft_weight: float = Field(0.0, ge=0.0, description="Add this times the chosen completion's token-mean "
                              "NLL to each pair's loss (RPO, Pang et al. 2024; TRL's loss_type [..., 'sft']: "
                              "keeps DPO from lowering the chosen answers' likelihood with the rejected).")
    center_rewards_coefficient: float = Field(
        0.0, ge=0.0, description="Reward models: add this times (r_chosen + r_rejected)^2 to each pair's "
        "loss, which keeps the scores centred on 0 (TRL's center_rewards_coefficient; 0: off)."
    )


class RLConfig(Section):
    """Reinforcement learning (objective rl): prompts, how completions are sampled for them and scored,
    and the policy-gradient loss. train.micro_batch_size counts prompts; each brings group_size
    completions. The chat template and the record checks are the sft section's settings."""

    data: list[str] = Field(
        default_factory=list, description="Prompts: .jsonl / .parquet files, folders of them or a saved "
        "`datasets` dir; each record a 'prompt' (string or messages) or chat 'messages', and the 'answer' "
        "rewards check against (`lmforge tasks` writes such records)."
    )
    val_data: list[str] = Field(default_factory=list, description="Held-out prompts (empty: rl.val_fraction "
                                "of the data). Validation scores the greedy reply to each.")
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Fraction of the prompts held out.")
    algorithm: Literal["grpo", "rloo", "ppo"] = Field(
        "grpo", description="grpo: group-normalised advantages and a clipped per-token loss (TRL's "
        "GRPOTrainer); rloo: leave-one-out baselines and a clipped sequence-level loss, its KL penalty in "
        "the reward (TRL's RLOOTrainer); ppo: a value head on the policy, per-token KL-penalty rewards, "
        "GAE advantages, the clipped policy and value losses."
    )
    group_size: int = Field(8, ge=1, description="Completions sampled per prompt (TRL's num_generations; "
                            "grpo and rloo need 2 or more, ppo takes 1).")
    iterations: int = Field(1, ge=1, description="Optimizer steps on each sampled batch (TRL's "
                            "num_iterations, the GRPO paper's mu, PPO epochs): a step's completions, "
                            "rewards, advantages and reference log-probs train this many consecutive steps, "
                            "clipped against the sampling policy's log-probs; its prompts count once.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="PPO: discount of GAE.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="PPO: GAE's lambda.")
    vf_coef: float = Field(0.1, ge=0.0, description="PPO: weight of the value loss.")
    cliprange_value: float | None = Field(0.2, gt=0.0, description="PPO: clip range of the value around the "
                                          "sampling-time value (None: unclipped).")
    max_new_tokens: int = Field(32, ge=1, description="Longest completion (TRL's max_completion_length).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of the completions.")
    top_k: int | None = Field(None, ge=1, description="Sample from the k most likely tokens only.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    rewards: dict[Literal["exact_match", "format", "reward_model"], float] = Field(
        default_factory=lambda: {"exact_match": 1.0}, description="Reward functions and their weights, "
        "summed: exact_match (1 when the reply's answer equals the record's 'answer', by the shipped task's "
        "checker when the record names one), format (1 when the reply is one line and ends its turn), "
        "reward_model (the score of rl.reward_model for prompt + reply)."
    )
    reward_model: str | None = Field(None, description="A reward model (an `lmforge reward` run or "
                                     "checkpoint dir) scoring each prompt + completion, for "
                                     "rewards.reward_model; it must use the policy's tokenizer.")
    scale_rewards: Literal["group", "batch", "none"] | None = Field(
        None, description="Divide advantages by the std of the group (grpo's default), of the whole batch, "
        "or not at all (Dr. GRPO; rloo's default). rloo takes none or batch (whitening)."
    )
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                              "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How grpo's per-token losses become one (verl's names): token-mean over "
        "the step's completion tokens (TRL dapo, the default), seq-mean-token-mean (TRL grpo), "
        "seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO: token sums / max_new_tokens)."
    )
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip range of the probability ratio.")
    clip_eps_high: float | None = Field(None, gt=0.0, description="Upper clip range (DAPO's clip-higher, "
                                        "e.g. 0.28); unset: clip_eps.")
    beta: float = Field(0.0, ge=0.0, description="KL penalty towards the reference model (the starting "
                        "model; 0 needs none). grpo adds beta x KL per token; rloo subtracts beta x the "
                        "sequence's summed log-ratio from its reward.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="grpo's per-token KL estimate "
                                                    "(k3: Schulman's, unbiased and >= 0).")

    @model_validator(mode="after")
    def _check(self) -> RLConfig:
        if self.algorithm != "ppo" and self.group_size < 2:
            raise ValueError(f"rl.group_size={self.group_size}: {self.algorithm} compares completions of a "
                             "prompt with each other and needs 2 or more")
        if self.algorithm == "rloo" and self.scale_rewards == "group":
            raise ValueError("rl.scale_rewards=group is for grpo; rloo's leave-one-out baseline takes none "
                             "or batch")
        if not self.rewards or any(w == 0 for w in self.rewards.values()):
            raise ValueError("rl.rewards needs at least one reward function with a non-zero weight")
        if ("reward_model" in self.rewards) != (self.reward_model is not None):
            raise ValueError("rl.rewards.reward_model and rl.reward_model go together: the weight of the "
                             "reward model's score, and the reward model (an `lmforge reward` run dir)")
        return self

    @property
    def reward_scaling(self) -> str:
        return self.scale_rewards or ("group" if self.algorithm == "grpo" else "none")
