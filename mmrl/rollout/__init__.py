"""Rollout engines behind one interface: ``generate(batch, sampling) -> batch``."""

from mmrl.rollout import module  # noqa: F401  (registers the engines)
from mmrl.rollout.base import ROLLOUT_ENGINES, RolloutEngine, get_rollout, register_rollout


@register_rollout("vllm")
def _vllm_rollout(**kwargs) -> RolloutEngine:
    """Imports vLLM (slow) only when a vLLM engine is built; the import re-registers the class."""
    from mmrl.rollout.vllm import VLLMRollout

    return VLLMRollout(**kwargs)


__all__ = ["ROLLOUT_ENGINES", "RolloutEngine", "get_rollout", "register_rollout"]
