"""Rollout engines behind one interface: ``generate(batch, sampling) -> batch``."""

from mmrl.rollout import hf  # noqa: F401  (registers the engine)
from mmrl.rollout.base import (
    ROLLOUT_ENGINES,
    RolloutEngine,
    SamplingParams,
    get_rollout,
    register_rollout,
)

__all__ = ["ROLLOUT_ENGINES", "RolloutEngine", "SamplingParams", "get_rollout", "register_rollout"]
