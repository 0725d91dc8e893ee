"""Ray mode: a resource pool of placement-group bundles and a worker group of Ray actors.

Each rank is one Ray actor running :class:`~mmrl.hybrid.group.WorkerHost`, pinned to
one bundle. Rank 0 picks the address of the process group's store; every rank then
joins the group (gloo on CPU, nccl on GPU) before its workers are built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mmrl.errors import MMRLError
from mmrl.hybrid.dispatch import Args
from mmrl.hybrid.group import WorkerError, WorkerGroup, WorkerHost

RemoteHost = ray.remote(WorkerHost)
PEER_DEATH_GRACE_S = 10.0


@dataclass
class ResourcePool:
    """``workers_per_node`` bundles on each of ``nnodes`` nodes; one bundle is one rank.

    Each node's bundles form one STRICT_PACK placement group, so they land on one machine.
    """

    nnodes: int
    workers_per_node: int
    cpus_per_worker: float
    gpus_per_worker: float = 0.0
    placement_groups: list[PlacementGroup] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.workers_per_node

    def reserve(self, timeout_s: float = 120.0) -> list[tuple[PlacementGroup, int]]:
        """Create the placement groups and return ``(group, bundle index)`` per rank."""
        bundle = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker
        self.placement_groups = [
            placement_group([bundle] * self.workers_per_node, strategy="STRICT_PACK")
            for _ in range(self.nnodes)
        ]
        try:
            ray.get([pg.ready() for pg in self.placement_groups], timeout=timeout_s)
        except GetTimeoutError:
            self.release()
            raise RuntimeError(
                f"the Ray cluster cannot place {self.nnodes} node(s) x {self.workers_per_node} "
                f"workers of {bundle} within {timeout_s:.0f} s; it has {ray.available_resources()} "
                "free. Lower trainer.n_workers_per_node / trainer.ray_num_cpus_per_worker or add "
                "nodes"
            ) from None
        return [(pg, i) for pg in self.placement_groups for i in range(self.workers_per_node)]

    def release(self) -> None:
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.placement_groups = []

    def cores(self, rank: int) -> list[int] | None:
        """Rank ``rank``'s own whole cores on a CPU node (positions among the node's CPUs), or
        None."""
        per_worker = int(self.cpus_per_worker)
        if self.gpus_per_worker or per_worker != self.cpus_per_worker or per_worker < 1:
            return None
        local_rank = rank % self.workers_per_node
        return list(range(local_rank * per_worker, (local_rank + 1) * per_worker))


class RayWorkerGroup(WorkerGroup):
    """One Ray actor per rank. Any rank's death or error stops the whole group.

    A dead rank leaves the others blocked in a collective, so the group does not wait
    for them: it raises :class:`WorkerError` at the first failure and kills the rest.
    """

    def __init__(
        self,
        hosts: list[Any],
        locations: list[str],
        role: str,
        worker_cls: type,
        pool: ResourcePool,
    ) -> None:
        super().__init__(role, worker_cls, world_size=len(hosts))
        self.hosts, self.locations, self.pool = hosts, locations, pool
        self.stopped: str | None = None

    @classmethod
    def spawn(
        cls,
        pool: ResourcePool,
        role: str,
        worker_cls: type,
        *args: Any,
        device_type: str,
        timeout_s: float,
        env_vars: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> RayWorkerGroup:
        """Start one actor per bundle of ``pool``, join them into a process group, build
        ``worker_cls``.
        """
        hosts = []
        for rank, (pg, bundle) in enumerate(pool.reserve()):
            cores = pool.cores(rank) if device_type == "cpu" else None
            threads = str(len(cores)) if cores else str(max(1, int(pool.cpus_per_worker)))
            options = {
                "num_cpus": pool.cpus_per_worker,
                "num_gpus": pool.gpus_per_worker,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=bundle
                ),
                "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads, **(env_vars or {})}},
            }
            hosts.append(
                RemoteHost.options(**options).remote(rank, pool.world_size, device_type, cores)
            )
        group = cls(hosts, ["starting"] * len(hosts), role, worker_cls, pool)
        group.locations = group._wait([h.location.remote() for h in hosts], "start")
        addr, port = group._wait([hosts[0].master_address.remote()], "start", ranks=[0])[0]
        group._wait(
            [h.init_process_group.remote(timeout_s, addr, port) for h in hosts],
            "init_process_group",
        )
        group._wait(
            [h.add_worker.remote(role, worker_cls, args, kwargs) for h in hosts],
            f"building {worker_cls.__name__}",
        )
        return group

    def colocate(self, role: str, worker_cls: type, *args: Any, **kwargs: Any) -> RayWorkerGroup:
        refs = [h.add_worker.remote(role, worker_cls, args, kwargs) for h in self.hosts]
        self._wait(refs, f"building {worker_cls.__name__}")
        return RayWorkerGroup(self.hosts, self.locations, role, worker_cls, self.pool)

    def _run(self, method: str, calls: list[Args]) -> list[Any]:
        if self.stopped:
            raise WorkerError(f"worker group {self.role!r} was stopped earlier: {self.stopped}")
        refs = [
            h.execute.remote(self.role, method, a, kw)
            for h, (a, kw) in zip(self.hosts, calls, strict=True)
        ]
        return self._wait(refs, method)

    def _wait(
        self, refs: list[ray.ObjectRef], what: str, ranks: list[int] | None = None
    ) -> list[Any]:
        """Results of ``refs`` in rank order; the first failure stops the group and is raised."""
        rank_of = dict(zip(refs, ranks or range(len(refs)), strict=True))
        results, pending = {}, list(refs)
        while pending:
            (ref,), pending = ray.wait(pending, num_returns=1)
            try:
                results[ref] = ray.get(ref)
            except RayError as err:
                rank, err = self._root_failure(rank_of[ref], err, pending, rank_of)
                raise self._failure(rank, what, err) from err
        return [results[ref] for ref in refs]

    def _root_failure(
        self, rank: int, err: RayError, pending: list[ray.ObjectRef], rank_of: dict
    ) -> tuple[int, RayError]:
        """The failure to report: a peer's death rather than the error it caused.

        A killed rank breaks the collective its peers are in, and a peer's "connection reset"
        error can reach the driver before Ray has noticed the death. Such a peer error is not
        the cause, and only a death can be recovered from (``trainer.max_restarts``), so the
        other ranks get a short grace to report one.
        """
        if isinstance(err, RayActorError) or isinstance(getattr(err, "cause", None), MMRLError):
            return rank, err
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_DEATH_GRACE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as death:
                return rank_of[ref], death
            except RayError:
                pass
        return rank, err

    def _failure(self, rank: int, what: str, err: RayError) -> Exception:
        """The error to raise for rank ``rank``'s failure; the group is stopped either way.

        An expected error (:class:`~mmrl.errors.MMRLError`, e.g. bad data on one rank) comes
        back as itself, in its short form, with the rank prefixed; anything else is a
        :class:`WorkerError` that carries the remote traceback.
        """
        how = "died" if isinstance(err, RayActorError) else "raised an error"
        step = f" at RL step {self.step}" if self.step is not None else ""
        message = (
            f"worker rank {rank} of {self.world_size} in group {self.role!r} "
            f"({self.locations[rank]}) {how} during {what}{step}"
        )
        self.shutdown()
        self.stopped = message
        cause = getattr(err, "cause", None)
        if isinstance(cause, MMRLError):
            return cause.at(f"rank {rank} of {self.world_size}{step}")
        return WorkerError(
            f"{message}; the group is stopped. Cause: {err}", rank, f"{how}: {exit_reason(err)}"
        )

    def shutdown(self) -> None:
        """Kill every rank and free the bundles; safe to call more than once."""
        for host in self.hosts:
            ray.kill(host)
        self.pool.release()
        self.stopped = self.stopped or "shut down"


def exit_reason(err: RayError) -> str:
    """The lines of Ray's error that say why the worker ended (its exit type and detail, e.g.
    killed by a signal or out of memory), else its first line; at most 300 characters."""
    lines = [line.strip() for line in str(getattr(err, "cause", None) or err).splitlines()]
    lines = [line for line in lines if line]
    exit_lines = [line for line in lines if "exit" in line.lower() or "killed" in line.lower()]
    return " ".join(exit_lines or lines[:1])[:300]
