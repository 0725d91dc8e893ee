"""trainer.loggers: every sink is read back from what it wrote (TensorBoard's EventAccumulator,
wandb's own reader of its offline run file, the JSONL file and the PNG images)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mmrl.config import load_config
from mmrl.errors import ConfigError
from mmrl.trainer.fit import fit
from mmrl.trainer.tracking import Tracker
from tests.conftest import run_overrides

STEPS = [
    {"critic/score/mean": 0.25, "actor/pg_loss": -0.5, "reward/invalid_rate": 0.0},
    {"critic/score/mean": 0.5, "actor/pg_loss": float("nan"), "count": 3},
    {"critic/score/mean": 0.75, "actor/pg_loss": 0.125},
]


@pytest.fixture
def offline_wandb(monkeypatch):
    """wandb never reaches the network in tests."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_images(log_dir: Path) -> dict[str, dict[int, np.ndarray]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    acc.Reload()
    return {
        tag: {
            e.step: np.asarray(Image.open(io.BytesIO(e.encoded_image_string)).convert("RGB"))
            for e in acc.Images(tag)
        }
        for tag in acc.Tags()["images"]
    }


def wandb_records(output_dir: Path) -> list[dict]:
    """The records of the run's .wandb file, as wandb's own reader prints them."""
    (run_file,) = output_dir.glob("wandb/*run-*/run-*.wandb")
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def wandb_history(output_dir: Path) -> dict[int, dict]:
    """step -> the metrics logged at that step (wandb may split one step over records)."""
    rows: dict[int, dict] = {}
    for rec in wandb_records(output_dir):
        if rec.get("type") == "history":
            item = rec["history"]["item"]
            rows.setdefault(int(item["_step"]), {}).update(item)
    return rows


def test_every_logger_writes_what_it_was_given(tmp_path, offline_wandb):
    image = np.zeros((6, 10, 3), np.uint8)
    image[:, :5] = (255, 0, 0)
    image[:, 5:] = (0, 0, 255)
    with Tracker(
        tmp_path, ["console", "jsonl", "tensorboard", "wandb"], config={"seed": 3}
    ) as tracker:
        for step, metrics in enumerate(STEPS, start=1):
            tracker.log(metrics, step)
        tracker.log_images({"val/frames": image}, step=3)

    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert jsonl == tracker.history
    assert jsonl[1] == {"step": 2, "actor/pg_loss": None, "count": 3, "critic/score/mean": 0.5}

    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["critic/score/mean"] == {1: 0.25, 2: 0.5, 3: 0.75}
    assert scalars["actor/pg_loss"] == {1: -0.5, 3: 0.125}  # the non-finite value is left out
    assert scalars["count"] == {2: 3.0}
    assert np.array_equal(tensorboard_images(tmp_path / "tensorboard")["val/frames"][3], image)

    history = wandb_history(tmp_path)
    assert [history[s]["critic/score/mean"] for s in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert history[1]["actor/pg_loss"] == -0.5 and "actor/pg_loss" not in history[2]
    logged = history[3]
    assert logged["val/frames._type"] == "image-file"
    (run_dir,) = tmp_path.glob("wandb/*run-*/files")
    assert np.array_equal(np.asarray(Image.open(run_dir / logged["val/frames.path"])), image)
    config = next(r for r in wandb_records(tmp_path) if r.get("type") == "run")
    assert config["run"]["config"]["update"]["seed"] == 3

    png = tmp_path / "images" / "val_frames" / "step_000003.png"
    assert np.array_equal(np.asarray(Image.open(png)), image)


def test_loggers_are_checked_and_verls_name_is_pointed_to():
    with pytest.raises(ConfigError, match=r"trainer\.loggers=\[console,tensorboard\]"):
        load_config(["trainer.logger=[console,tensorboard]"])
    with pytest.raises(ConfigError, match="trainer.loggers"):
        load_config(["trainer.loggers=[console,mlflow]"])


def test_a_run_logs_the_same_metrics_to_every_logger(tmp_path, tiny_lm_dirs, offline_wandb):
    """A short run on a tiny random model: TensorBoard and wandb hold every finite scalar of
    metrics.jsonl, at its step."""
    cfg = load_config(
        run_overrides(
            tmp_path,
            f"actor_rollout_ref.model.path={tiny_lm_dirs['untied']}",
            "trainer.loggers=[jsonl,tensorboard,wandb]",
            "trainer.total_steps=2",
            "trainer.test_freq=2",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
        )
    )
    result = fit(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows == result.history
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    history = wandb_history(tmp_path)
    for row in rows:
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, int | float)}
        assert ("val/score/mean" in numbers) == (row["step"] != 1)  # validated at 0 and 2
        for key, value in numbers.items():
            assert scalars[key][row["step"]] == pytest.approx(value, rel=1e-6), key
            assert history[row["step"]][key] == pytest.approx(value, rel=1e-12), key
    assert os.environ["WANDB_MODE"] == "offline"


def test_a_resumed_tracker_continues_every_log_as_one_run(tmp_path, offline_wandb):
    """Killed after step 3 with a checkpoint at step 2: the resumed tracker keeps steps <= 2,
    and what it logs from step 3 on replaces the killed run's step 3 everywhere."""
    loggers = ["jsonl", "tensorboard", "wandb"]
    with Tracker(tmp_path, loggers) as first:
        for step, metrics in enumerate(STEPS, start=1):
            first.log(metrics, step)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "critic/sc')  # a line the kill cut short
    with Tracker(tmp_path, loggers, resume_step=2) as resumed:
        assert [r["step"] for r in resumed.history] == [1, 2]
        resumed.log({"critic/score/mean": 0.875}, 3)
        resumed.log({"critic/score/mean": 1.0}, 4)
        resumed.truncate(3)  # a worker died in step 4; the run restarts from step 3
        resumed.log({"critic/score/mean": 0.5}, 4)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["critic/score/mean"]) for r in rows] == [
        (1, 0.25),
        (2, 0.5),
        (3, 0.875),
        (4, 0.5),
    ]
    assert rows == resumed.history
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["critic/score/mean"] == {1: 0.25, 2: 0.5, 3: 0.875, 4: 0.5}
    # Offline, the resumed part is a second folder of the same wandb run (wandb sync joins them).
    run_files = list(tmp_path.glob("wandb/*run-*/run-*.wandb"))
    assert len(run_files) == 2 and len({p.name for p in run_files}) == 1
