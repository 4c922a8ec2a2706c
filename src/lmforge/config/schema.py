"""The one typed config tree. Every field has a default and a one-line doc (its `description`).

YAML is its serialised form (`lmforge.config.load`), `--set a.b=c` the only second level. Unknown keys,
wrong types and out-of-range values are errors raised before any work starts.
"""

from __future__ import annotations

from pydantic import Field, model_validator

# Each area's sections live in their own module; they are re-exported here, where the tree has always
# been imported from (`from lmforge.config.schema import ModelConfig`).
from lmforge.config.classify import ClassifyConfig
from lmforge.config.curate import CurateConfig
from lmforge.config.data import DataConfig, RunConfig, TokenizerConfig
from lmforge.config.infill import GLMConfig, PrefixLMConfig
from lmforge.config.masking import MLMConfig, SpanCorruptionConfig
from lmforge.config.methods import (
    CausalLMObjective,
    DistillConfig,
    GKDConfig,
    ObjectiveConfig,
    PreferenceConfig,
    RLConfig,
    SFTConfig,
    check_arch,
)
from lmforge.config.model import MLAConfig, ModelConfig, MoEConfig, QuantConfig, RopeScalingConfig
from lmforge.config.optim import AdamWConfig, OptimConfig
from lmforge.config.qa import QAConfig
from lmforge.config.runtime import (
    EvalConfig,
    GenerateConfig,
    LoggingConfig,
    MlflowConfig,
    ParallelConfig,
    WandbConfig,
)
from lmforge.config.section import Section
from lmforge.config.seq2seq import Seq2SeqConfig
from lmforge.config.token_classify import TokenClassifyConfig
from lmforge.config.train import (
    UNIT_SUFFIX,
    AveragingConfig,
    CheckpointConfig,
    FinetuneConfig,
    ScheduleConfig,
    StabilityConfig,
    TrainConfig,
    parse_duration,
)

__all__ = [
    "UNIT_SUFFIX", "AveragingConfig", "CheckpointConfig", "Config", "CurateConfig", "DataConfig",
    "DistillConfig", "EvalConfig", "FinetuneConfig", "GKDConfig", "GenerateConfig", "LoggingConfig",
    "MLAConfig", "MLMConfig", "MlflowConfig", "ModelConfig", "MoEConfig", "ObjectiveConfig", "OptimConfig",
    "ParallelConfig", "PreferenceConfig", "QuantConfig", "RLConfig", "RopeScalingConfig", "RunConfig",
    "SFTConfig", "ScheduleConfig", "StabilityConfig", "TokenizerConfig", "TrainConfig", "WandbConfig",
    "parse_duration",
    "ClassifyConfig",  # objective classify's section (config/classify.py)
    "PrefixLMConfig", "GLMConfig",  # objectives prefix_lm's and glm's sections (config/infill.py)
    "TokenClassifyConfig", "QAConfig",  # objectives tag and qa (config/token_classify.py, config/qa.py)
    "Seq2SeqConfig",  # objective seq2seq (config/seq2seq.py)
]


class Config(Section):
    """The whole run: what `lmforge <verb> -c run.yaml` reads."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and directory.")
    data: DataConfig = Field(default_factory=DataConfig, description="Text sources and preparation.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Model architecture.")
    optim: OptimConfig = Field(default_factory=AdamWConfig, description="Optimizer: optim.name picks one; "
                               "its own settings sit in optim.<name>.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="Learning-rate schedule.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")
    objective: ObjectiveConfig = Field(default_factory=CausalLMObjective, description="Training method: "
                                     "objective.name picks one (causal_lm, sft, dpo, reward, rl, distill, "
                                     "mlm, gkd, classify, prefix_lm, glm, tag, qa); its settings sit in its "
                                     "own section.")
    sft: SFTConfig = Field(default_factory=SFTConfig,
                           description="Supervised fine-tuning data (objective sft).")
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig,
                                         description="Preference pairs and loss (objective dpo).")
    rl: RLConfig = Field(default_factory=RLConfig, description="RL prompts, sampling, rewards and loss "
                         "(objective rl).")
    distill: DistillConfig = Field(default_factory=DistillConfig,
                                   description="Teacher and losses of knowledge distillation (objective "
                                   "distill).")
    mlm: MLMConfig = Field(default_factory=MLMConfig, description="Masking of objective mlm.")
    span_corruption: SpanCorruptionConfig = Field(default_factory=SpanCorruptionConfig, description="Spans "
                                                  "of objective span_corruption (T5 pretraining).")
    gkd: GKDConfig = Field(default_factory=GKDConfig, description="Teacher, divergence and on-policy "
                           "sampling of generalized knowledge distillation (objective gkd).")
    prefix_lm: PrefixLMConfig = Field(default_factory=PrefixLMConfig, description="Prefix boundaries of "
                                      "objective prefix_lm.")
    glm: GLMConfig = Field(default_factory=GLMConfig, description="Blanks of objective glm (GLM's "
                           "autoregressive blank infilling).")
    classify: ClassifyConfig = Field(default_factory=ClassifyConfig, description="Labelled data and head "
                                     "of sequence classification / regression (objective classify).")
    token_classify: TokenClassifyConfig = Field(default_factory=TokenClassifyConfig, description="Tagged "
                                                "words and per-token head of token classification (objective "
                                                "tag).")
    qa: QAConfig = Field(default_factory=QAConfig, description="SQuAD-like data and span head of extractive "
                         "question answering (objective qa).")
    seq2seq: Seq2SeqConfig = Field(default_factory=Seq2SeqConfig, description="Input -> target records of "
                                   "sequence-to-sequence fine-tuning of an encoder-decoder (objective "
                                   "seq2seq, `lmforge sft` on model.arch=t5).")
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig,
                                     description="Full fine-tuning or LoRA / DoRA / QLoRA adapters.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    stability: StabilityConfig = Field(default_factory=StabilityConfig,
                                       description="Non-finite guard, loss-spike recovery, early stopping.")
    averaging: AveragingConfig = Field(default_factory=AveragingConfig, description="Weight EMA and SWA.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Distributed layout.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logging.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="`lmforge eval` settings.")
    generate: GenerateConfig = Field(default_factory=GenerateConfig,
                                     description="`lmforge generate` settings.")
    curate: CurateConfig = Field(default_factory=CurateConfig,
                                 description="`lmforge data` corpus-cleaning pipeline.")

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        seq = self.train.seq_len
        if seq is not None and seq > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len={seq} exceeds model.max_seq_len={self.model.max_seq_len}; "
                "lower train.seq_len or raise model.max_seq_len"
            )
        if self.schedule.unit == "time" and self.train.max_time is None:
            raise ValueError("schedule.unit=time spreads the schedule over the wall-clock budget: set "
                             "train.max_time (e.g. 5m), or count steps or tokens (schedule.unit)")
        check_arch(self.objective.name, self.model.arch)
        return self

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self.model.max_seq_len
