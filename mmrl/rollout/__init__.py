"""Rollout engines behind one interface: ``generate(batch, sampling) -> batch``."""

from mmrl.rollout import module  # noqa: F401  (registers the engines)
from mmrl.rollout.base import ROLLOUT_ENGINES, RolloutEngine, get_rollout, register_rollout

__all__ = ["ROLLOUT_ENGINES", "RolloutEngine", "get_rollout", "register_rollout"]
