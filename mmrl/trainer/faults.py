"""Fault recovery: a Ray worker that dies restarts the worker group from the latest checkpoint.

With ``trainer.max_restarts=K``, a :class:`~mmrl.hybrid.WorkerError` whose rank *died*
(killed, out of memory, its node lost) does not end the run: the fit loop tears the
group down, starts a new one and continues from ``latest_checkpointed_iteration.txt``
(or from step 1 when no checkpoint was written yet), up to K times. An error a worker
*raised* (a bug, bad data) would only happen again, so it still ends the run.

Every restart is one line of ``<output_dir>/faults.jsonl`` (step, dead rank, exit reason,
where the run went on from), a log warning, and the metrics ``fault/restarts`` (on every
later step) and ``fault/dead_rank`` (on the first step after the restart).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

from mmrl.hybrid import WorkerError, Workers
from mmrl.trainer import checkpoint as ckpt

log = logging.getLogger(__name__)
FAULTS_FILE = "faults.jsonl"


class FaultRecovery:
    """Counts restarts and decides whether a worker failure is one to recover from."""

    def __init__(self, output_dir: Path, max_restarts: int) -> None:
        self.output_dir, self.max_restarts = output_dir, max_restarts
        self.restarts = 0
        self._dead_rank: int | None = None

    def recover(self, err: WorkerError, step: int | None) -> Path | None:
        """Record ``err`` and return the checkpoint to continue from (None: from the start);
        re-raise it when it is not recoverable or the restarts are used up."""
        if not err.worker_died or self.restarts >= self.max_restarts:
            if err.worker_died and self.max_restarts:
                log.error("worker restarts exhausted (trainer.max_restarts=%d)", self.max_restarts)
            raise err
        self.restarts += 1
        self._dead_rank = err.rank
        folder = ckpt.latest_checkpoint(self.output_dir)
        record = {
            "step": step,
            "dead_rank": err.rank,
            "reason": err.reason,
            "restart": self.restarts,
            "resumed_from": str(folder) if folder is not None else None,
        }
        with (self.output_dir / FAULTS_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")
        log.warning(
            "worker rank %s died at step %s (%s); restart %d of %d from %s",
            err.rank,
            step,
            err.reason,
            self.restarts,
            self.max_restarts,
            folder or "the start",
        )
        return folder

    def metrics(self) -> dict[str, Any]:
        """``fault/*`` metrics for the step being logged (none before the first restart)."""
        if not self.restarts:
            return {}
        out: dict[str, Any] = {"fault/restarts": self.restarts}
        if self._dead_rank is not None:
            out["fault/dead_rank"] = self._dead_rank
            self._dead_rank = None
        return out


def kill_worker_point(step: int, workers: Workers, restarts: int) -> None:
    """Test hook: ``MMRL_TEST_KILL_AT=worker:after_step:N`` SIGKILLs the last rank's process
    after step N, as a crashed or OOM-killed worker would die. A comma-separated list kills
    once per point: the k-th point fires in the group started after k restarts."""
    points = os.environ.get(ckpt.KILL_ENV, "").split(",")
    if restarts < len(points) and points[restarts] == f"worker:after_step:{step}":
        os.kill(workers.actor.pid()[-1], signal.SIGKILL)
