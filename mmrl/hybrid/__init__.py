"""Workers and worker groups: the hybrid engine (actor + rollout + reference), FSDP2, dispatch, Ray.

The fit loop needs :func:`build_workers`; the rest is here for tests, benchmarks and
anyone building other groups.
"""

from mmrl.hybrid.dispatch import Dispatch, register
from mmrl.hybrid.group import LocalWorkerGroup, WorkerError, WorkerGroup, WorkerHost
from mmrl.hybrid.launch import Workers, build_workers, init_ray
from mmrl.hybrid.worker import ActorRolloutRefWorker, CriticWorker

__all__ = [
    "ActorRolloutRefWorker",
    "CriticWorker",
    "Dispatch",
    "LocalWorkerGroup",
    "WorkerError",
    "WorkerGroup",
    "WorkerHost",
    "Workers",
    "build_workers",
    "init_ray",
    "register",
]
