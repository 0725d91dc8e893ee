"""Workers that colocate actor, rollout and reference (the hybrid engine)."""

from mmrl.hybrid.worker import ActorRolloutRefWorker, CriticWorker, load_causal_lm

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "load_causal_lm"]
