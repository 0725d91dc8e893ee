"""Build a run's worker groups from ``trainer.*``: in-process, on a local Ray, or on a cluster.

- One worker and no ``trainer.ray_address``: the embedded mode. The workers run in
  the trainer's process over a one-rank process group; Ray is not started.
- Otherwise Ray mode: ``trainer.ray_address`` (``auto`` or ``host:port``) joins a
  running cluster; without it a local Ray is started with just the CPUs the workers
  reserve and an explicit object store (the default sizes do not fit beside the
  colocated engines in 24 GiB).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mmrl.config import RunConfig, TrainerConfig
from mmrl.hybrid.group import LocalWorkerGroup, WorkerGroup
from mmrl.hybrid.worker import ActorRolloutRefWorker, CriticWorker

log = logging.getLogger(__name__)
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Workers:
    """The worker groups of one run; ``with workers:`` shuts them down at the end."""

    actor: WorkerGroup
    critic: WorkerGroup | None
    owns_ray: bool = False  # this run connected the driver to Ray, so it disconnects at the end

    def set_step(self, step: int) -> None:
        """Record the RL step in progress, so a worker failure can name it."""
        for group in (self.actor, self.critic):
            if group is not None:
                group.step = step

    def shutdown(self) -> None:
        for group in (self.critic, self.actor):
            if group is not None:
                group.shutdown()
        _disconnect(self.owns_ray)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def build_workers(
    cfg: RunConfig, model_path: str | Path, need_ref: bool, need_critic: bool
) -> Workers:
    """The actor/rollout/ref group and, with ``need_critic``, the critic group."""
    t = cfg.trainer
    world_size = t.nnodes * t.n_workers_per_node
    if world_size < 1:
        raise ValueError(
            f"trainer.nnodes={t.nnodes} x trainer.n_workers_per_node={t.n_workers_per_node} gives "
            "no workers"
        )
    if world_size == 1 and not t.ray_address:
        return _embedded(cfg, model_path, need_ref, need_critic)
    return _on_ray(cfg, model_path, need_ref, need_critic)


def _embedded(cfg: RunConfig, model_path, need_ref: bool, need_critic: bool) -> Workers:
    device_type = _resolve_device(cfg.trainer.device, gpus_available=torch.cuda.is_available())
    actor = LocalWorkerGroup.spawn(
        "actor",
        ActorRolloutRefWorker,
        cfg,
        model_path,
        need_ref,
        device_type=device_type,
        timeout_s=cfg.trainer.dist_timeout_s,
    )
    critic = actor.colocate("critic", CriticWorker, cfg, model_path) if need_critic else None
    return Workers(actor, critic)


def _on_ray(cfg: RunConfig, model_path, need_ref: bool, need_critic: bool) -> Workers:
    import ray

    from mmrl.hybrid.ray_group import RayWorkerGroup, ResourcePool

    t = cfg.trainer
    separate_critic = need_critic and not t.colocate_critic
    owns_ray = init_ray(t, pools=2 if separate_critic else 1)
    device_type = _resolve_device(
        t.device, gpus_available=ray.cluster_resources().get("GPU", 0) > 0
    )
    log.info(
        "Ray mode: %d node(s) x %d worker(s) on %s", t.nnodes, t.n_workers_per_node, device_type
    )

    def pool() -> ResourcePool:
        gpus = 1.0 if device_type == "cuda" else 0.0
        return ResourcePool(t.nnodes, t.n_workers_per_node, t.ray_num_cpus_per_worker, gpus)

    common = {"device_type": device_type, "timeout_s": t.dist_timeout_s, "env_vars": WORKER_ENV}
    actor = critic = None
    try:
        actor = RayWorkerGroup.spawn(
            pool(), "actor", ActorRolloutRefWorker, cfg, model_path, need_ref, **common
        )
        if separate_critic:
            critic = RayWorkerGroup.spawn(pool(), "critic", CriticWorker, cfg, model_path, **common)
        elif need_critic:
            critic = actor.colocate("critic", CriticWorker, cfg, model_path)
    except BaseException:
        for group in (critic, actor):
            if group is not None:
                group.shutdown()
        _disconnect(owns_ray)
        raise
    return Workers(actor, critic, owns_ray)


def init_ray(t: TrainerConfig, pools: int = 1) -> bool:
    """Connect this driver to Ray as ``trainer.*`` asks; True if this call did the connecting.

    An already-connected driver (a test session, a notebook) is used as it is.
    """
    import ray

    if ray.is_initialized():
        return False
    if t.ray_address:
        ray.init(address=t.ray_address)
        return True
    if t.nnodes > 1:
        raise ValueError(
            f"trainer.nnodes={t.nnodes} needs a running Ray cluster: start one with `ray start` "
            "and set trainer.ray_address"
        )
    gpus = (
        torch.cuda.device_count()
        if _resolve_device(t.device, torch.cuda.is_available()) == "cuda"
        else 0
    )
    # address="local" always starts a new Ray, never attaching to another user's `ray start`.
    ray.init(
        address="local",
        num_cpus=math.ceil(pools * t.n_workers_per_node * t.ray_num_cpus_per_worker),
        num_gpus=gpus,
        object_store_memory=t.ray_object_store_mb * 2**20,
        include_dashboard=False,
        # Ray's GCS keeps an event record of every task for its state API, which mmrl does not
        # use: about 0.08 MiB more per RL step, 20+ MiB over a 300-step run (benchmarks/
        # bench_soak.py). Without the reports the GCS stays flat.
        _system_config={"task_events_report_interval_ms": 0},
    )
    return True


def _resolve_device(name: str, gpus_available: bool) -> str:
    if name == "auto":
        return "cuda" if gpus_available else "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device={name!r}; expected auto, cpu or cuda")
    return name


def _disconnect(owns_ray: bool) -> None:
    if owns_ray:
        import ray

        ray.shutdown()
