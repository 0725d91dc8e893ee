"""The run's tracker: keeps the history and hands each step to the ``trainer.loggers`` sinks.

Images (uint8 [H, W, 3], e.g. a world model's frame strips at validation) are also saved as
PNG files under ``<output_dir>/images/<name>/step_<N>.png``, whatever the loggers, so the run
folder holds everything a report needs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmrl.trainer.loggers import CONSOLE_KEYS, LOGGER_NAMES, MetricSink, build_sinks, read_jsonl

__all__ = ["CONSOLE_KEYS", "LOGGER_NAMES", "Tracker"]


class Tracker:
    """Writes every metric to the sinks of ``loggers`` and keeps them in :attr:`history`.

    Args:
        output_dir: the run's folder; sinks write under it.
        loggers: names from :data:`LOGGER_NAMES` (``trainer.loggers``).
        project, name: the run's project and name (wandb shows them).
        config: the run's config as plain data (wandb stores it with the run).
        resume_step: a run resumed from this step's checkpoint: ``history`` starts with the
            records of ``metrics.jsonl`` up to that step, the JSONL file keeps those lines
            and drops later ones, TensorBoard hides later events, wandb continues its run, so
            the logs read as one run.
    """

    def __init__(
        self,
        output_dir: Path,
        loggers: list[str],
        project: str = "mmrl",
        name: str = "run",
        config: dict | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.history: list[dict[str, Any]] = []
        if resume_step is not None:
            records = read_jsonl(self.output_dir / "metrics.jsonl")
            self.history = [r for r in records if r["step"] <= resume_step]
        self.sinks: list[MetricSink] = build_sinks(
            list(loggers), self.output_dir, project, name, config or {}, resume_step
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        values = {k: _plain(v) for k, v in sorted(metrics.items())}
        self.history.append({"step": step, **values})
        for sink in self.sinks:
            sink.log(values, step)

    def log_images(self, images: dict[str, np.ndarray], step: int) -> None:
        """Save each uint8 [H, W, 3] image as a PNG in the run folder and send it to the sinks."""
        for key, image in images.items():
            folder = self.output_dir / "images" / key.replace("/", "_")
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"step_{step:06d}.png")
        for sink in self.sinks:
            sink.log_images(images, step)

    def truncate(self, step: int) -> None:
        """Forget every record after ``step`` (a restart from that step's checkpoint; -1:
        from the start): in ``history`` and in the sinks that can."""
        self.history = [r for r in self.history if r["step"] <= step]
        for sink in self.sinks:
            sink.truncate(step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain(value: Any) -> float | int | str | None:
    if isinstance(value, int | str):
        return value
    value = float(value)
    return value if math.isfinite(value) else None
