"""config: the typed schema (schema.py), Hydra composition (compose.py), validation (validate.py), the
command line's --help and override checks (cli.py) and DeepSpeed configs (ds_config.py).
Imports core/ and algos/ (the registries a key names), never the layers above. Importing this package
(schema + composition) loads no torch: validate.py, which does, is imported by name where it is used.
"""
from rlhf.config.compose import as_yaml, compose, register_schemas, to_config
from rlhf.config.schema import (
    DTYPES, PRECISIONS, REWARD_SOURCES, SCHEMAS, AlarmsConfig, CadenceConfig, DataConfig, DPOAlgoConfig, DPOConfig,
    EvaluateConfig, FrozenModelConfig, GenerationConfig, LoggerConfig, LoraConfig, ModelConfig, OptimGroupConfig,
    PPOAlgoConfig, PPOConfig, PPOTrainConfig, RewardConfig, RewardLossConfig, RewardSourcesConfig, RolloutConfig,
    SERVED_REWARDS, ServeConfig, ServedRewardConfig, ServerConfig, SFTConfig, StageConfig, StartsConfig, TrainConfig,
    TrainedModelConfig, stage_engine,
)
from rlhf.core.errors import ConfigError

__all__ = [
    "DTYPES", "PRECISIONS", "REWARD_SOURCES", "SCHEMAS", "AlarmsConfig", "CadenceConfig", "ConfigError",
    "DPOAlgoConfig", "DPOConfig", "DataConfig", "EvaluateConfig", "FrozenModelConfig", "GenerationConfig",
    "LoggerConfig", "LoraConfig", "ModelConfig", "OptimGroupConfig", "PPOAlgoConfig", "PPOConfig", "PPOTrainConfig",
    "RewardConfig", "RewardLossConfig", "RewardSourcesConfig", "RolloutConfig", "SERVED_REWARDS", "SFTConfig",
    "ServeConfig", "ServedRewardConfig", "ServerConfig", "StageConfig", "StartsConfig",
    "TrainConfig", "TrainedModelConfig", "as_yaml", "compose", "register_schemas", "stage_engine", "to_config",
]
