"""The typed run config (:mod:`mmrl.config.schema`) and how it is composed and loaded."""

from mmrl.config.load import compose, config_dir, load_config, to_schema
from mmrl.config.schema import (
    ActorConfig,
    ActorRolloutRefConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    KLControlConfig,
    ModelConfig,
    PolicyLossConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
    ValKwargs,
    VerifierSpec,
)
from mmrl.config.validate import old_log_prob_source

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DataConfig",
    "KLControlConfig",
    "ModelConfig",
    "PolicyLossConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainerConfig",
    "ValKwargs",
    "VerifierSpec",
    "compose",
    "config_dir",
    "load_config",
    "old_log_prob_source",
    "to_schema",
]
