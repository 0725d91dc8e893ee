"""Worker processes for verifier calls that may be slow, crash or hang.

A hang cannot be interrupted inside the trainer's process, so process-mode verifiers
run here: each call goes to a worker process with a deadline; a worker that misses it
is killed and replaced. Locally that is :class:`ProcessPool` (forkserver workers,
persistent across steps); when Ray is initialised, :class:`RayPool` runs the same calls
on Ray actors (actor tasks) and kills the actor of a late call.

A call is ``Call(ref, kwargs, batch)``: the worker resolves ``ref`` itself (see
:func:`mmrl.verifiers.plugins.portable_ref`), so nothing but data crosses the boundary.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from mmrl.protocol import Batch

POLL_S = 0.5  # longest wait without a deadline, so a dead worker is noticed


@dataclass
class Call:
    """One verifier call: ``resolve(ref)(batch, **kwargs)`` with ``timeout_s`` (None: no limit)."""

    ref: str
    kwargs: dict[str, Any]
    batch: Batch
    timeout_s: float | None = None


@dataclass
class CallResult:
    """``status`` is ok | raise | timeout | crash; ``value`` is the return value or an error
    message.
    """

    status: str
    value: Any = None
    duration_s: float = 0.0


def execute(ref: str, kwargs: dict[str, Any], batch: Batch) -> tuple[str, Any]:
    """Run one call inside a worker; never raises (errors come back as ``("raise", message)``)."""
    try:
        fn = _resolve_cached(ref)
        return "ok", fn(batch, **kwargs)
    except BaseException as err:  # a plugin may raise anything, even SystemExit
        return "raise", f"{type(err).__name__}: {err}"


_RESOLVED: dict[str, Any] = {}


def _resolve_cached(ref: str) -> Any:
    if ref not in _RESOLVED:
        from mmrl.verifiers.plugins import resolve

        _RESOLVED[ref] = resolve(ref)
    return _RESOLVED[ref]


def _worker_main(conn: Connection) -> None:
    import torch

    torch.set_num_threads(1)  # several workers share the machine's cores
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        ref, kwargs, batch = pickle.loads(message)
        status, value = execute(ref, kwargs, batch)
        try:
            payload = pickle.dumps((status, value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:
            payload = pickle.dumps(
                ("raise", f"result could not be pickled: {type(err).__name__}: {err}")
            )
        conn.send_bytes(payload)


_MAIN_LOCK = threading.Lock()


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start processes without making them import ``__main__``.

    multiprocessing's spawn and forkserver children re-import the parent's main module,
    which runs an unguarded script again and fails for ``python -`` or notebooks.
    Workers resolve verifiers by reference and never need ``__main__``, so its
    ``__file__`` and ``__spec__`` are hidden while a worker starts.
    """
    main = sys.modules["__main__"]
    with _MAIN_LOCK:
        saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
        try:
            yield
        finally:
            main.__dict__.update(saved)


@dataclass
class _Worker:
    process: Any
    conn: Connection
    task: int | None = None
    started: float = 0.0
    deadline: float | None = None


class ProcessPool:
    """``num_workers`` persistent worker processes, started on first use.

    ``run(calls)`` blocks until every call has a result; a call past its ``timeout_s``
    gets ``timeout`` and its worker is killed, a worker that dies gives ``crash``.
    """

    def __init__(self, num_workers: int = 2) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, found {num_workers}")
        self.num_workers = num_workers
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        self._ctx = mp.get_context(method)
        if method == "forkserver":
            # Workers fork from a server that has already imported torch and mmrl, so a
            # replacement for a killed worker starts in milliseconds, not seconds.
            self._ctx.set_forkserver_preload(["torch", "mmrl.verifiers.pool", "mmrl.verifiers"])
        self._workers: list[_Worker] = []

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main, args=(child,), daemon=True, name="mmrl-verifier"
        )
        with _main_module_hidden():
            process.start()
        child.close()
        worker = _Worker(process, parent)
        self._workers.append(worker)
        return worker

    def _kill(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()
        self._workers.remove(worker)

    def run(self, calls: list[Call]) -> list[CallResult]:
        results: list[CallResult | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        while pending or any(w.task is not None for w in self._workers):
            self._dispatch(calls, pending, results)
            busy = [w for w in self._workers if w.task is not None]
            if not busy:
                continue
            deadlines = [w.deadline for w in busy if w.deadline is not None]
            now = time.perf_counter()
            wait_s = min([POLL_S, *(max(d - now, 0.0) for d in deadlines)])
            ready = wait([w.conn for w in busy], timeout=wait_s)
            now = time.perf_counter()
            for worker in busy:
                if worker.conn in ready:
                    self._receive(worker, results, now)
                elif not worker.process.is_alive():
                    results[worker.task] = CallResult(
                        "crash", _exit_message(worker), now - worker.started
                    )
                    self._kill(worker)
                elif worker.deadline is not None and now >= worker.deadline:
                    results[worker.task] = CallResult(
                        "timeout",
                        f"no result after {calls[worker.task].timeout_s} s",
                        now - worker.started,
                    )
                    self._kill(worker)
        return [r for r in results if r is not None]

    def _dispatch(
        self, calls: list[Call], pending: deque[int], results: list[CallResult | None]
    ) -> None:
        while pending:
            idle = [w for w in self._workers if w.task is None]
            if not idle and len(self._workers) >= self.num_workers:
                return
            worker = idle[0] if idle else self._start()
            index = pending.popleft()
            call = calls[index]
            try:
                message = pickle.dumps(
                    (call.ref, call.kwargs, call.batch.to("cpu")), protocol=pickle.HIGHEST_PROTOCOL
                )
            except Exception as err:
                results[index] = CallResult(
                    "raise", f"batch could not be pickled: {type(err).__name__}: {err}"
                )
                continue
            try:
                worker.conn.send_bytes(message)
            except (BrokenPipeError, OSError) as err:
                results[index] = CallResult("crash", f"worker unreachable: {err}")
                self._kill(worker)
                continue
            worker.task, worker.started = index, time.perf_counter()
            worker.deadline = None if call.timeout_s is None else worker.started + call.timeout_s

    def _receive(self, worker: _Worker, results: list[CallResult | None], now: float) -> None:
        try:
            status, value = pickle.loads(worker.conn.recv_bytes())
        except (EOFError, OSError):
            results[worker.task] = CallResult("crash", _exit_message(worker), now - worker.started)
            self._kill(worker)
            return
        results[worker.task] = CallResult(status, value, now - worker.started)
        worker.task, worker.deadline = None, None

    def close(self) -> None:
        for worker in list(self._workers):
            self._kill(worker)


def _exit_message(worker: _Worker) -> str:
    worker.process.join(timeout=1)
    return f"worker process exited with code {worker.process.exitcode}"


class _RayWorker:
    """A Ray actor that runs verifier calls; ``ready`` imports mmrl before any deadline starts."""

    def ready(self) -> bool:
        import mmrl.verifiers.plugins  # noqa: F401

        return True

    def execute(self, ref: str, kwargs: dict[str, Any], batch: Batch) -> tuple[str, Any]:
        return execute(ref, kwargs, batch)


class RayPool:
    """``num_workers`` Ray actors, the Ray counterpart of :class:`ProcessPool`.

    A call's timeout starts when it is handed to a started actor, so a worker's cold
    start never counts against it. An actor past its deadline is killed and replaced.
    Actors reserve no CPU: the Ray that mmrl starts for its workers has exactly the
    CPUs their bundles hold, and a verifier actor waiting for a free CPU would wait
    forever. An actor that does not start within ``start_timeout_s`` is an error.
    """

    def __init__(self, num_workers: int = 2, start_timeout_s: float = 120.0) -> None:
        import ray

        self._ray = ray
        self._actor_cls = ray.remote(num_cpus=0, max_restarts=0)(_RayWorker)
        self.num_workers, self.start_timeout_s = num_workers, start_timeout_s
        self._idle: list[Any] = []
        self._starting: dict[Any, tuple[Any, float]] = {}  # ready() ref -> (actor, start time)

    def run(self, calls: list[Call]) -> list[CallResult]:
        ray = self._ray
        results: list[CallResult | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        running: dict[Any, tuple[Any, int, float]] = {}  # result ref -> (actor, call index, start)
        while pending or running:
            while len(self._idle) + len(self._starting) + len(running) < self.num_workers:
                actor = self._actor_cls.remote()
                self._starting[actor.ready.remote()] = (actor, time.perf_counter())
            while pending and self._idle:
                index, actor = pending.popleft(), self._idle.pop()
                call = calls[index]
                ref = actor.execute.remote(call.ref, call.kwargs, call.batch.to("cpu"))
                running[ref] = (actor, index, time.perf_counter())
            ready, _ = ray.wait([*self._starting, *running], num_returns=1, timeout=POLL_S)
            now = time.perf_counter()
            for ref in ready:
                if ref in self._starting:
                    actor, _ = self._starting.pop(ref)
                    ray.get(ref)  # an actor that cannot start is a cluster problem: raise
                    self._idle.append(actor)
                    continue
                actor, index, started = running.pop(ref)
                try:
                    status, value = ray.get(ref)
                    self._idle.append(actor)
                except Exception as err:  # the actor died: drop it, a new one replaces it
                    status, value = "crash", f"{type(err).__name__}: {err}"
                results[index] = CallResult(status, value, now - started)
            for _, since in self._starting.values():
                if now - since > self.start_timeout_s:
                    raise RuntimeError(
                        f"a verifier worker actor did not start within {self.start_timeout_s:.0f} "
                        "s; "
                        f"the Ray cluster has {ray.available_resources()} free"
                    )
            for ref, (actor, index, started) in list(running.items()):
                timeout_s = calls[index].timeout_s
                if timeout_s is not None and now - started >= timeout_s:
                    ray.kill(actor)  # ends the process that runs the stuck call
                    del running[ref]
                    results[index] = CallResult(
                        "timeout", f"no result after {timeout_s} s", now - started
                    )
        return [r for r in results if r is not None]

    def close(self) -> None:
        if self._ray.is_initialized():
            for actor in [*self._idle, *(a for a, _ in self._starting.values())]:
                self._ray.kill(actor)
        self._idle, self._starting = [], {}
