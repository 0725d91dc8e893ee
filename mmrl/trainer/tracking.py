"""Metrics sinks: a console line per step and a JSONL file per run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from mmrl.errors import ConfigError

CONSOLE_KEYS = (
    "critic/score/mean",
    "reward/invalid_rate",
    "val/score/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "response_length/mean",
    "timing_s/step",
)


class Tracker:
    """Writes every metric to ``<output_dir>/metrics.jsonl`` and a summary to the console."""

    def __init__(self, output_dir: Path, loggers: list[str]) -> None:
        unknown = set(loggers) - {"console", "jsonl"}
        if unknown:
            raise ConfigError(
                f"trainer.loggers has unknown entries {sorted(unknown)}; known: console, jsonl"
            )
        self.console = "console" in loggers
        self.path = output_dir / "metrics.jsonl" if "jsonl" in loggers else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
        self.history: list[dict[str, Any]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        self.history.append(record)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.console:
            # A key is missing (or None, not finite) when a step has no value for it, e.g. no
            # valid sample: the line shows what there is.
            shown = " ".join(
                f"{k}={record[k]:.4g}" for k in CONSOLE_KEYS if record.get(k) is not None
            )
            tqdm.write(f"step {step}: {shown}")


def _plain(value: Any) -> float | int | str | None:
    if isinstance(value, int | str):
        return value
    value = float(value)
    return value if math.isfinite(value) else None
