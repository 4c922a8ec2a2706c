"""The typed config tree and its YAML form."""

from lmforge.config.load import dump_config, load_config, save_config, validate_config
from lmforge.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    GenerateConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    RopeScalingConfig,
    RunConfig,
    ScheduleConfig,
    TokenizerConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig", "Config", "DataConfig", "EvalConfig", "GenerateConfig", "LoggingConfig",
    "ModelConfig", "OptimConfig", "RopeScalingConfig", "RunConfig", "ScheduleConfig", "TokenizerConfig",
    "TrainConfig",
    "dump_config", "load_config", "save_config", "validate_config",
]
