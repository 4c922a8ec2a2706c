"""The typed config tree and its YAML form."""

from lmforge.config.load import dump_config, load_config, save_config, validate_config
from lmforge.config.schema import (
    AveragingConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    GenerateConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RopeScalingConfig,
    RunConfig,
    ScheduleConfig,
    StabilityConfig,
    TokenizerConfig,
    TrainConfig,
)

__all__ = [
    "AveragingConfig", "CheckpointConfig", "Config", "DataConfig", "EvalConfig", "GenerateConfig",
    "LoggingConfig",
    "ModelConfig", "OptimConfig", "ParallelConfig", "RopeScalingConfig", "RunConfig", "ScheduleConfig",
    "StabilityConfig", "TokenizerConfig",
    "TrainConfig",
    "dump_config", "load_config", "save_config", "validate_config",
]
