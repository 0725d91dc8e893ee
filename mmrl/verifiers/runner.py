"""The verifier runner: batching, parallelism, timeouts, failure isolation, metrics.

``VerifierRunner(specs).run(batch)`` scores a batch with every configured verifier
and sums the weighted scores. ``submit(batch)`` does the same in a background
thread and returns a Future, so the trainer can compute old log-probs meanwhile.

- ``batch`` mode: one vectorised call in this process. If it raises, each sample is
  called alone to find the failing ones.
- ``process`` mode: calls of ``chunk_size`` samples run in worker processes (Ray actors
  when Ray is initialised) with a per-call timeout; a failed chunk is retried sample
  by sample. These run while the batch-mode verifiers run here.

A verifier that breaks its contract (not one score per sample) raises
:class:`~mmrl.verifiers.base.VerifierOutputError`: that is a bug, not a sample's fault.
A sample a verifier could not score (it raised, timed out, crashed its worker,
returned NaN/inf, or said so in ``valid``) is invalid: its summed score is 0 and
``valid`` is False, which the algorithm core turns into ``valid_mask``. Only
verifiers with a nonzero weight decide validity. The first error of each kind is
logged once per verifier, naming the sample.

Metrics: ``reward/<name>/mean`` (over the samples it scored), ``reward/<name>/errors``
and ``reward/<name>/errors/<kind>`` (counts in this batch), ``reward/<name>/<metric>``
(its own metrics, averaged over its valid samples), ``timing_s/reward/<name>``
(wall seconds for batch mode; summed worker-call seconds for process mode) and
``reward/invalid_rate``. A mean over no scored sample is left out, not reported as 0.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from mmrl.protocol import Batch
from mmrl.verifiers.base import VerifierOutput, VerifierOutputError, check_output, row_mask
from mmrl.verifiers.pool import Call, CallResult, ProcessPool, RayPool
from mmrl.verifiers.spec import BoundVerifier, bind_all, spec_key

log = logging.getLogger(__name__)
ERROR_KINDS = ("raise", "timeout", "crash", "nonfinite")
DEFAULT_TIMEOUT_S = 60.0


class _Scores:
    """One verifier's results over a batch of ``n`` samples, filled in row by row."""

    def __init__(self, n: int) -> None:
        self.scores = np.zeros(n)
        self.valid = np.zeros(n, dtype=bool)
        self.errors: dict[str, np.ndarray] = {}  # kind -> bool [n], made at the first such error
        self.first_error: dict[str, tuple[int, str]] = {}
        self.metrics: dict[str, np.ndarray] = {}
        self.duration_s = 0.0

    def set(self, rows: np.ndarray, out: VerifierOutput, nonfinite: np.ndarray) -> None:
        if out.scores.ndim == 2 and self.scores.ndim == 1:  # per-frame scores [n, F]
            self.scores = np.zeros((len(self.scores), out.scores.shape[1]))
        if out.scores.ndim != self.scores.ndim or out.scores.shape[1:] != self.scores.shape[1:]:
            raise VerifierOutputError(
                f"a verifier returned scores {list(out.scores.shape)} for {len(rows)} rows "
                f"after {list(self.scores.shape[1:])} per sample for others of the same batch"
            )
        self.scores[rows], self.valid[rows] = out.scores, out.valid
        if nonfinite.any():
            self.fail(rows[nonfinite], "nonfinite", "score is NaN or inf")
        for key, value in out.metrics.items():
            column = self.metrics.setdefault(key, np.full(len(self.scores), np.nan))
            try:
                column[rows] = np.broadcast_to(
                    np.asarray(value, dtype=np.float64).reshape(-1), rows.shape
                )
            except (TypeError, ValueError):
                column[rows] = np.nan  # a metric that is not a float or [rows] floats is dropped

    def fail(self, rows: np.ndarray, kind: str, message: str) -> None:
        self.valid[rows], self.scores[rows] = False, 0.0
        self.errors.setdefault(kind, np.zeros(len(self.scores), dtype=bool))[rows] = True
        if kind not in self.first_error and len(rows):
            self.first_error[kind] = (int(rows[0]), message)


class VerifierRunner:
    """Runs the verifiers of ``reward.verifiers`` over batches; see the module docstring.

    Args:
        specs: ``VerifierSpec`` objects, ``(name, weight)`` pairs, dicts or names.
        num_workers: worker processes for process-mode verifiers (default: CPU count, at most 8).
        timeout_s: per-call timeout for process-mode verifiers that set none themselves.
    """

    def __init__(
        self, specs: Sequence[Any], num_workers: int | None = None, timeout_s: float | None = None
    ) -> None:
        self.verifiers: list[BoundVerifier] = bind_all(specs)
        self.num_workers = num_workers or min(8, os.cpu_count() or 1)
        self.timeout_s = timeout_s or DEFAULT_TIMEOUT_S
        self._pool: ProcessPool | RayPool | None = None
        self._logged: set[tuple[str, str]] = set()
        # (verifier name, error kind) -> the latest run's first message of that kind
        self.error_examples: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()  # one run at a time: the worker pool is not shared
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def from_config(cls, reward: Any) -> VerifierRunner:
        """Build from a ``RewardConfig`` (``verifiers``, ``num_workers``, ``timeout_s``)."""
        return cls(
            reward.verifiers,
            getattr(reward, "num_workers", None),
            getattr(reward, "timeout_s", None),
        )

    # ----- public API -----------------------------------------------------------------

    def run(self, batch: Batch) -> VerifierOutput:
        """Score ``batch`` [B]: summed weighted scores [B], valid [B] and metrics."""
        with self._lock:
            n = len(batch)
            results: dict[str, _Scores] = {}
            background = [v for v in self.verifiers if v.options.mode == "process"]
            worker_future = (
                self._start_process_mode(background, batch) if background and n else None
            )
            for v in self.verifiers:
                if v.options.mode == "batch":
                    results[v.name] = self._run_inline(v, batch)
            if worker_future is not None:
                results.update(worker_future.result())
            for v in background:
                results.setdefault(v.name, _Scores(n))
            self._log_errors(results, batch)
            return self._combine(results, n)

    def submit(self, batch: Batch) -> Future[VerifierOutput]:
        """Run :meth:`run` in a background thread; the caller may add fields to ``batch``
        meanwhile."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmrl-verify")
        snapshot = batch.select()  # new containers: later fields added by the caller stay out
        return self._executor.submit(self.run, snapshot)

    def close(self) -> None:
        """Stop worker processes and the background thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> VerifierRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- batch mode -------------------------------------------------------------------

    def _run_inline(self, v: BoundVerifier, batch: Batch) -> _Scores:
        n = len(batch)
        res = _Scores(n)
        start = time.perf_counter()
        try:
            res.set(np.arange(n), *check_output(v.name, v.fn(batch), n))
        except VerifierOutputError:
            raise  # a broken verifier is a bug to fix, not a sample to skip
        except Exception as err:
            if n == 1:
                res.fail(np.arange(1), "raise", _describe(err))
            else:
                self._log_once(
                    v.name,
                    "fallback",
                    f"verifier {v.name!r}: the batched call raised {_describe(err)}; scoring the "
                    f"{n} samples one by one",
                )
                for i in range(n):
                    try:
                        res.set(np.array([i]), *check_output(v.name, v.fn(batch[i]), 1))
                    except VerifierOutputError:
                        raise
                    except Exception as sample_err:
                        res.fail(np.array([i]), "raise", _describe(sample_err))
        res.duration_s = time.perf_counter() - start
        return res

    # ----- process mode -----------------------------------------------------------------

    def _start_process_mode(
        self, verifiers: list[BoundVerifier], batch: Batch
    ) -> Future[dict[str, _Scores]]:
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmrl-verify-workers")
        future = executor.submit(self._run_in_workers, verifiers, batch)
        executor.shutdown(wait=False)
        return future

    def _run_in_workers(self, verifiers: list[BoundVerifier], batch: Batch) -> dict[str, _Scores]:
        n = len(batch)
        results = {v.name: _Scores(n) for v in verifiers}
        jobs = []  # (verifier, rows)
        for v in verifiers:
            size = v.options.chunk_size
            jobs += [(v, np.arange(i, min(i + size, n))) for i in range(0, n, size)]
        retry = self._collect(jobs, self._call(jobs, batch), results)
        if retry:  # failed multi-sample calls: find the failing samples one by one
            singles = [(v, np.array([i])) for v, rows in retry for i in rows]
            leftover = self._collect(singles, self._call(singles, batch), results)
            assert not leftover, "single-sample calls are never retried"
        return results

    def _call(self, jobs: list[tuple[BoundVerifier, np.ndarray]], batch: Batch) -> list[CallResult]:
        # Rows of a call are contiguous: a slice is a view, far cheaper than gathering by index.
        calls = [
            Call(
                v.portable or v.ref,
                v.kwargs,
                batch[int(rows[0]) : int(rows[-1]) + 1],
                v.options.timeout_s or self.timeout_s,
            )
            for v, rows in jobs
        ]
        use_ray = "ray" in sys.modules and sys.modules["ray"].is_initialized()
        if self._pool is None or isinstance(self._pool, RayPool) != use_ray:
            if self._pool is not None:
                self._pool.close()
            self._pool = RayPool(self.num_workers) if use_ray else ProcessPool(self.num_workers)
        return self._pool.run(calls)

    def _collect(
        self,
        jobs: list[tuple[BoundVerifier, np.ndarray]],
        outcomes: list[CallResult],
        results: dict[str, _Scores],
    ) -> list[tuple[BoundVerifier, np.ndarray]]:
        """Record each call's outcome; return the failed multi-sample calls to retry."""
        retry = []
        for (v, rows), outcome in zip(jobs, outcomes, strict=True):
            res = results[v.name]
            res.duration_s += outcome.duration_s
            status, message = outcome.status, str(outcome.value)
            if status == "ok":
                res.set(rows, *check_output(v.name, outcome.value, len(rows)))
                continue
            if len(rows) > 1:
                retry.append((v, rows))
            else:
                res.fail(rows, status, message)
        return retry

    # ----- results ----------------------------------------------------------------------

    def _combine(self, results: dict[str, _Scores], n: int) -> VerifierOutput:
        """Weighted sum of the verifiers' scores: [n], or [n, F] when any is per-frame (a
        per-sample score then counts on the last frame, where a sequence reward sits)."""
        frames = {r.scores.shape[1] for r in results.values() if r.scores.ndim == 2}
        if len(frames) > 1:
            raise VerifierOutputError(f"verifiers returned per-frame scores for {frames} frames")
        total = np.zeros((n, *frames))
        valid = np.ones(n, dtype=bool)
        metrics: dict[str, float] = {}
        for v in self.verifiers:
            res = results[v.name]
            if total.ndim == 2 and res.scores.ndim == 1:
                total[:, -1] += v.weight * res.scores
            else:
                total += v.weight * res.scores
            if v.weight != 0.0:
                valid &= res.valid
            prefix = f"reward/{v.name}"
            scored = np.count_nonzero(res.valid)
            if scored:  # with no scored sample a mean would be a made-up 0; it is left out
                metrics[f"{prefix}/mean"] = float(res.scores[res.valid].sum() / scored)
            for kind in ERROR_KINDS:
                rows = res.errors.get(kind)
                metrics[f"{prefix}/errors/{kind}"] = (
                    float(np.count_nonzero(rows)) if rows is not None else 0.0
                )
            failed = np.logical_or.reduce(list(res.errors.values())) if res.errors else None
            metrics[f"{prefix}/errors"] = (
                float(np.count_nonzero(failed)) if failed is not None else 0.0
            )
            for key, column in res.metrics.items():
                kept = column[res.valid & ~np.isnan(column)]
                if kept.size:
                    metrics[f"{prefix}/{key}"] = float(kept.mean())
            metrics[f"timing_s/reward/{v.name}"] = res.duration_s
        metrics["reward/invalid_rate"] = 1.0 - np.count_nonzero(valid) / n if n else 0.0
        return VerifierOutput(
            scores=np.where(row_mask(valid, total), total, 0.0),
            valid=valid,
            metrics=metrics,
            # per-sample, as validation reports them: per-frame scores summed over frames
            verifier_scores={v.name: per_sample(results[v.name].scores) for v in self.verifiers},
        )

    def _log_errors(self, results: dict[str, _Scores], batch: Batch) -> None:
        uids = batch.non_tensor.get("uid")
        for name, res in results.items():
            for kind, (row, message) in res.first_error.items():
                self.error_examples[(name, kind)] = message
                uid = f", uid {uids[row]!r}" if uids is not None else ""
                self._log_once(
                    name, kind,
                    f"verifier {name!r}: {kind} on sample {row}{uid}: {message} (sample marked "
                    "invalid; "
                    f"later {kind} errors of this verifier are only counted in "
                    f"reward/{name}/errors/{kind})",
                )  # fmt: skip

    def _log_once(self, name: str, kind: str, message: str) -> None:
        if (name, kind) not in self._logged:
            self._logged.add((name, kind))
            log.warning(message)


def per_sample(scores: np.ndarray) -> np.ndarray:
    """Scores [B] as they are (a copy); per-frame scores [B, F] summed over frames."""
    return scores.copy() if scores.ndim == 1 else scores.sum(1)


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


# ----- the function the fit loop calls ------------------------------------------------------

_RUNNERS: dict[tuple, VerifierRunner] = {}


def get_runner(
    verifiers: Sequence[Any], num_workers: int | None = None, timeout_s: float | None = None
) -> VerifierRunner:
    """A runner for these specs, created once per process and reused (its workers stay up)."""
    key = (tuple(spec_key(s) for s in verifiers), num_workers, timeout_s)
    if key not in _RUNNERS:
        _RUNNERS[key] = VerifierRunner(verifiers, num_workers, timeout_s)
    return _RUNNERS[key]


def score_batch(
    batch: Batch,
    verifiers: Sequence[Any],
    num_workers: int | None = None,
    timeout_s: float | None = None,
) -> VerifierOutput:
    """Run each verifier and combine them as a weighted sum (see :class:`VerifierRunner`).

    ``verifiers``: ``(name, weight)`` pairs or ``VerifierSpec``-like entries. The runner
    (and its worker processes) is reused across calls with the same arguments.
    """
    return get_runner(verifiers, num_workers, timeout_s).run(batch)


@atexit.register
def _close_runners() -> None:
    for runner in _RUNNERS.values():
        runner.close()
    _RUNNERS.clear()
