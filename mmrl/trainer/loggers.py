"""Metric sinks, one class per ``trainer.loggers`` entry: console, jsonl, tensorboard, wandb.

Each sink takes one step's scalars (``log``) and images (``log_images``: uint8 [H, W, 3]
arrays, e.g. a world model's frame strips at validation) and writes them its own way:

- ``console``: one line per step with the headline metrics (images are not shown);
- ``jsonl``: ``<output_dir>/metrics.jsonl``, one JSON object per step (images are saved as
  PNG files by the tracker, whatever the sinks);
- ``tensorboard``: event files under ``<output_dir>/tensorboard/`` (scalars and images);
  ``tensorboard --logdir <output_dir>/tensorboard`` shows them;
- ``wandb``: a Weights & Biases run whose local files live under ``<output_dir>/wandb/``.
  ``WANDB_MODE=offline`` keeps it off the network (``wandb sync`` uploads it later).
  wandb is an optional dependency: ``pip install 'mmrl[wandb]'``.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm

from mmrl.errors import ConfigError

try:  # an optional extra: only a run that asks for it needs it
    import wandb
except ImportError:  # pragma: no cover - depends on the install
    wandb = None

LOGGER_NAMES = ("console", "jsonl", "tensorboard", "wandb")

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


class MetricSink:
    """What every logger does; a sink ignores what it cannot show."""

    def log(self, record: dict[str, Any], step: int) -> None:
        """``record``: metric name -> float, int, str or None (no value this step)."""

    def log_images(self, images: dict[str, np.ndarray], step: int) -> None:
        """``images``: name -> uint8 [H, W, 3]."""

    def truncate(self, step: int) -> None:
        """Forget what was logged after ``step`` (a run resumed from that step's checkpoint)."""

    def close(self) -> None:
        """Flush and release files."""


class ConsoleSink(MetricSink):
    def log(self, record: dict[str, Any], step: int) -> None:
        # A key is missing (or None, not finite) when a step has no value for it, e.g. no
        # valid sample: the line shows what there is.
        shown = " ".join(f"{k}={record[k]:.4g}" for k in CONSOLE_KEYS if record.get(k) is not None)
        tqdm.write(f"step {step}: {shown}")


class JsonlSink(MetricSink):
    """Appends one JSON line per step to ``path``; a new run starts the file empty, a resumed
    one keeps the lines up to its checkpoint's step."""

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        else:
            self.truncate(resume_step)

    def log(self, record: dict[str, Any], step: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **record}) + "\n")

    def truncate(self, step: int) -> None:
        kept = [r for r in read_jsonl(self.path) if r["step"] <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (none if it is missing); a line that a killed run
    left half-written is skipped."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class TensorBoardSink(MetricSink):
    """Scalars and images as TensorBoard event files in ``log_dir``."""

    def __init__(self, log_dir: Path, resume_step: int | None = None) -> None:
        self.log_dir = log_dir
        self.writer = self._open(resume_step)

    def _open(self, resume_step: int | None) -> SummaryWriter:
        # Flushed every few seconds, so a live run shows in TensorBoard without waiting for
        # its end. purge_step hides the events of steps after a resumed checkpoint.
        purge = resume_step + 1 if resume_step is not None else None
        return SummaryWriter(log_dir=str(self.log_dir), flush_secs=10, purge_step=purge)

    def truncate(self, step: int) -> None:
        self.writer.close()
        self.writer = self._open(step)

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step)

    def log_images(self, images: dict[str, np.ndarray], step: int) -> None:
        for key, image in images.items():
            self.writer.add_image(key, image, global_step=step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class WandbSink(MetricSink):
    """One wandb run per training run, its files under ``output_dir/wandb``. A resumed run
    continues the same wandb run (its id is kept in ``output_dir/wandb/mmrl_run_id``); wandb
    keeps the values it already has for the steps between the checkpoint and the kill, which
    an exact resume logs again unchanged."""

    def __init__(
        self,
        output_dir: Path,
        project: str,
        name: str,
        config: dict,
        resume_step: int | None = None,
    ) -> None:
        if wandb is None:
            raise ConfigError(
                "trainer.loggers includes wandb, but the wandb package is not installed",
                fix="pip install 'mmrl[wandb]' (or drop wandb from trainer.loggers)",
            )
        id_file = output_dir / "wandb" / "mmrl_run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        resumed = resume_step is not None and id_file.is_file()
        run_id = id_file.read_text().strip() if resumed else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self.run = wandb.init(
            project=project,
            name=name,
            dir=str(output_dir),
            config=config,
            id=run_id,
            resume="allow" if resumed else None,
        )

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log({k: v for k, v in record.items() if v is not None}, step=step)

    def log_images(self, images: dict[str, np.ndarray], step: int) -> None:
        self.run.log({k: wandb.Image(v) for k, v in images.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


def build_sinks(
    names: list[str],
    output_dir: Path,
    project: str,
    name: str,
    config: dict,
    resume_step: int | None = None,
) -> list[MetricSink]:
    """The sinks ``trainer.loggers`` names, in its order; ``resume_step``: they continue a run
    from that step's checkpoint."""
    unknown = sorted(set(names) - set(LOGGER_NAMES))
    if unknown:
        raise ConfigError(
            f"trainer.loggers has unknown entries {unknown}; known: {', '.join(LOGGER_NAMES)}"
        )
    make = {
        "console": ConsoleSink,
        "jsonl": lambda: JsonlSink(output_dir / "metrics.jsonl", resume_step),
        "tensorboard": lambda: TensorBoardSink(output_dir / "tensorboard", resume_step),
        "wandb": lambda: WandbSink(output_dir, project, name, config, resume_step),
    }
    return [make[n]() for n in dict.fromkeys(names)]
