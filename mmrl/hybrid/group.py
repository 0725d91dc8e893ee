"""Worker groups: one role's workers on every data-parallel rank, called like one object.

``group.update_actor(batch, seed=...)`` looks up how ``update_actor`` is dispatched
(:mod:`mmrl.hybrid.dispatch`), runs it on every rank and merges the results.
:class:`LocalWorkerGroup` runs the single rank in the trainer's process (the embedded
mode); :class:`RayWorkerGroup` runs one Ray actor per rank. Both host the same
worker classes through :class:`WorkerHost`, so the fit loop cannot tell them apart.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch

from mmrl.hybrid import fsdp
from mmrl.hybrid.dispatch import Args, collect, dispatch_mode, split_args


class WorkerError(RuntimeError):
    """A worker died or raised; the message names the group, the rank, the call and the RL step.

    ``rank`` is the failed rank and ``reason`` what ended it (``died: ...`` when its process
    went away, which a restart from a checkpoint can recover from).
    """

    def __init__(self, message: str, rank: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.rank, self.reason = rank, reason

    @property
    def worker_died(self) -> bool:
        return self.reason.startswith("died")

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.reason)


class WorkerHost:
    """What one rank's process holds: its place in the process group and one worker per role.

    Ray runs one host per actor (``ray.remote(WorkerHost)``); the embedded mode builds
    one in-process. Roles that share a host (actor and a colocated critic) share the
    process, its process group and its cores.
    """

    def __init__(
        self, rank: int, world_size: int, device_type: str, cores: list[int] | None = None
    ) -> None:
        """``cores``: positions in this process's allowed CPUs to pin it to (None: no pinning)."""
        self.rank, self.world_size, self.device_type = rank, world_size, device_type
        self.workers: dict[str, Any] = {}
        allowed = sorted(os.sched_getaffinity(0))
        if cores and max(cores) < len(allowed):
            # Ranks that share a machine each get their own cores instead of all contending for all
            # of them.
            os.sched_setaffinity(0, [allowed[i] for i in cores])
            torch.set_num_threads(len(cores))

    def location(self) -> str:
        return f"pid {os.getpid()} on {socket.gethostname()}"

    def master_address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the process group's store."""
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_process_group(
        self, timeout_s: float, master_addr: str | None = None, master_port: int | None = None
    ) -> None:
        fsdp.init_process_group(
            self.rank, self.world_size, self.device_type, timeout_s, master_addr, master_port
        )

    def add_worker(self, role: str, worker_cls: type, args: tuple, kwargs: dict) -> None:
        self.workers[role] = worker_cls(*args, **kwargs)

    def execute(self, role: str, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.workers[role], method)(*args, **kwargs)


class WorkerGroup:
    """Calls the ``@register``-ed methods of one role's worker class on every rank.

    Subclasses implement ``_run`` (run one method on every rank with per-rank
    arguments) and ``colocate`` (add another role to the same processes).
    """

    def __init__(self, role: str, worker_cls: type, world_size: int) -> None:
        self.role, self.worker_cls, self.world_size = role, worker_cls, world_size
        self.step: int | None = None  # the RL step in progress; failures name it

    def __getattr__(self, method: str) -> Callable[..., Any]:
        worker_cls = self.__dict__.get("worker_cls")
        if worker_cls is None or method.startswith("_"):  # copy/pickle probes, half-built objects
            raise AttributeError(method)
        mode = dispatch_mode(worker_cls, method)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls, pad_size = split_args(mode, self.world_size, args, kwargs, method)
            return collect(mode, self._run(method, calls), pad_size)

        call.__name__ = method
        return call

    def _run(self, method: str, calls: list[Args]) -> list[Any]:
        raise NotImplementedError

    def colocate(self, role: str, worker_cls: type, *args: Any, **kwargs: Any) -> WorkerGroup:
        """A group for another role whose workers live in these processes (same ranks)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop the group's processes (nothing to do in-process)."""


class LocalWorkerGroup(WorkerGroup):
    """One rank in the trainer's own process, over a one-rank process group: the embedded mode."""

    def __init__(self, host: WorkerHost, role: str, worker_cls: type) -> None:
        super().__init__(role, worker_cls, world_size=1)
        self.host = host

    @classmethod
    def spawn(
        cls,
        role: str,
        worker_cls: type,
        *args: Any,
        device_type: str,
        timeout_s: float,
        **kwargs: Any,
    ) -> LocalWorkerGroup:
        host = WorkerHost(rank=0, world_size=1, device_type=device_type)
        host.init_process_group(timeout_s)
        host.add_worker(role, worker_cls, args, kwargs)
        return cls(host, role, worker_cls)

    def colocate(self, role: str, worker_cls: type, *args: Any, **kwargs: Any) -> LocalWorkerGroup:
        self.host.add_worker(role, worker_cls, args, kwargs)
        return LocalWorkerGroup(self.host, role, worker_cls)

    def _run(self, method: str, calls: list[Args]) -> list[Any]:
        ((args, kwargs),) = calls
        return [self.host.execute(self.role, method, args, kwargs)]
