"""Exact resume in real processes: `mmrl train` killed with SIGKILL (between steps, inside a
save, a Ray worker mid-run) and run again continues as if it had never stopped.

Every later metric except machine measurements (times, memory, throughput) must equal an
uninterrupted run's bit for bit: same seed, same machine, same thread count.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmrl.config import load_config
from mmrl.hybrid import build_workers
from mmrl.hybrid.state import OPTIMIZER_FILE, read_weights
from mmrl.models import policy_family
from mmrl.trainer.checkpoint import KILL_ENV
from tests.conftest import run_overrides
from tests.test_checkpoint import comparable

pytestmark = pytest.mark.slow
KEYS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean")


def overrides(out: Path, model_dir: Path, *extra: str) -> list[str]:
    return run_overrides(
        out,
        f"actor_rollout_ref.model.path={model_dir}",
        "trainer.total_steps=5",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "task.val_size=8",
        "trainer.ray_object_store_mb=256",
        # A run resumed at another worker count is held to fp32 rounding (1e-5 relative);
        # bf16 rounds differently for every micro-batch shape.
        "trainer.mixed_precision=fp32",
        *extra,
    )


def train(out: Path, model_dir: Path, *extra: str, kill_at: str = "") -> int:
    env = {**os.environ, KILL_ENV: kill_at}
    argv = [sys.executable, "-m", "mmrl.trainer.cli", "train", *overrides(out, model_dir, *extra)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, -9), proc.stderr[-3000:]
    return proc.returncode


def history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(resumed: Path, full: Path, ignore: tuple[str, ...] = ()) -> None:
    a, b = comparable(history(resumed)), comparable(history(full))
    for rows in (a, b):
        for row in rows.values():
            for key in [k for k in row if k.startswith(ignore)]:
                del row[key]
    assert list(a) == list(b) == [0, 1, 2, 3, 4, 5]
    assert all(key in b[5] for key in KEYS) and "val/score/mean" in b[4]
    assert a == b


def test_text_run_killed_between_steps_and_inside_a_save_continues_exactly(
    tmp_path, warm_model_dir
):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert train(full, warm_model_dir) == 0
    assert train(resumed, warm_model_dir, kill_at="after_step:3") == -9
    assert (resumed / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    # Killed again: step 4's checkpoint written but not yet renamed into place.
    assert train(resumed, warm_model_dir, kill_at="save:after_write:4") == -9
    assert (resumed / ".tmp_global_step_4").is_dir() and not (resumed / "global_step_4").exists()
    assert (resumed / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    assert train(resumed, warm_model_dir) == 0
    assert_same_run(resumed, full)


@pytest.fixture(scope="module")
def two_worker_run(tmp_path_factory, warm_model_dir) -> Path:
    out = tmp_path_factory.mktemp("ray") / "full"
    assert train(out, warm_model_dir, "trainer.n_workers_per_node=2") == 0
    return out


@pytest.fixture(scope="module")
def killed_two_worker_run(tmp_path_factory, warm_model_dir) -> Path:
    """A 2-worker run killed after step 3 (its last checkpoint is step 2). Each test resumes
    its own copy."""
    out = tmp_path_factory.mktemp("ray") / "killed"
    assert train(out, warm_model_dir, "trainer.n_workers_per_node=2", kill_at="after_step:3") == -9
    return out


def test_two_worker_run_resumed_at_two_workers_continues_exactly(
    tmp_path, warm_model_dir, two_worker_run, killed_two_worker_run
):
    out = shutil.copytree(killed_two_worker_run, tmp_path / "resumed")
    assert train(out, warm_model_dir, "trainer.n_workers_per_node=2") == 0
    assert_same_run(out, two_worker_run)


def test_dead_workers_restart_from_the_start_then_from_the_checkpoint_and_the_run_finishes(
    tmp_path, warm_model_dir, two_worker_run
):
    """A rank dies after step 1, before any checkpoint: the new group begins at step 1 from the
    initial state (prompt order, KL controller, RNGs). A rank of that group dies after step 3:
    the next one resumes from step 2's checkpoint. The run ends as if nothing died."""
    out = tmp_path / "fault"
    extra = ("trainer.n_workers_per_node=2", "trainer.max_restarts=2")
    kills = "worker:after_step:1,worker:after_step:3"
    assert train(out, warm_model_dir, *extra, kill_at=kills) == 0
    first, second = [json.loads(x) for x in (out / "faults.jsonl").read_text().splitlines()]
    assert first["resumed_from"] is None and first["step"] == 2 and first["dead_rank"] == 1
    assert first["reason"].startswith("died")
    assert second["resumed_from"].endswith("global_step_2") and second["step"] == 4
    rows = comparable(history(out))
    assert "fault/restarts" not in rows[0]
    assert rows[1]["fault/restarts"] == 1 and rows[1]["fault/dead_rank"] == 1
    assert rows[3]["fault/restarts"] == 2 and rows[3]["fault/dead_rank"] == 1
    assert rows[5]["fault/restarts"] == 2
    assert_same_run(out, two_worker_run, ignore=("fault/",))


def test_a_two_worker_checkpoint_loads_into_one_worker_bit_for_bit(
    tmp_path, warm_model_dir, two_worker_run
):
    """At another worker count the saved weights and optimizer state are what one worker
    holds after loading, bit for bit (each rank keeps its shard of the full state)."""
    folder = two_worker_run / "global_step_4"
    cfg = load_config(overrides(tmp_path, warm_model_dir))
    workers = build_workers(cfg, warm_model_dir, need_ref=False, need_critic=False)
    with workers:
        workers.actor.load_checkpoint(folder)
        (weights,) = workers.actor.full_state_dict()
        saved = policy_family(folder / "actor").load(folder / "actor").state_dict()
        assert weights.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(weights[name], value), name
        workers.actor.save_checkpoint(tmp_path / "again")
    before = read_weights(folder / "actor_optim" / OPTIMIZER_FILE)
    after = load_file(tmp_path / "again" / "actor_optim" / OPTIMIZER_FILE)
    assert before.keys() == after.keys() and len(before) > 0
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def test_a_two_worker_run_resumed_at_one_worker_continues_within_1e_5(
    tmp_path, warm_model_dir, two_worker_run, killed_two_worker_run
):
    """Rows carry their own sampling seeds and each optimizer step sees the same global
    mini-batch at any worker count, so only the order of reductions differs: every later
    metric is within 1e-5 relative of the run that kept its 2 workers (1e-6 absolute for
    values near 0, such as a group-normalised policy loss). ``rollout/logprob_diff_*``
    measure rounding itself (rollout against recomputed log-probs, about 1e-6), so they
    differ by their own size and are only checked to stay that small."""
    out = shutil.copytree(killed_two_worker_run, tmp_path / "resumed")
    assert train(out, warm_model_dir) == 0  # one in-process worker
    a, b = comparable(history(out)), comparable(history(two_worker_run))
    assert list(a) == list(b) == [0, 1, 2, 3, 4, 5]
    assert a[2] == b[2]  # before the resume: the same run
    assert all(key in a[5] for key in KEYS) and "val/score/mean" in a[4]
    off = []
    for step in (3, 4, 5):
        assert a[step].keys() == b[step].keys(), step
        for key, value in b[step].items():
            if key.startswith("rollout/logprob_diff"):
                assert a[step][key] < 1e-4, (step, key, a[step][key])
            elif isinstance(value, float):
                if not math.isclose(a[step][key], value, rel_tol=1e-5, abs_tol=1e-6):
                    off.append((step, key, a[step][key], value))
            elif a[step][key] != value:
                off.append((step, key, a[step][key], value))
    assert not off, off


def test_latent_world_model_run_killed_between_steps_continues_exactly(tmp_path):
    """The world-model kind of policy (Gaussian latent steps, its autoencoder) resumes too."""
    from tests.test_worldmodel_latent_rl import TINY

    work = tmp_path / "work"  # shared: the autoencoder and pretraining are made once
    extra = (*TINY, f"task.work_dir={work}", "trainer.val_before_train=true")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    model = Path("unused")  # the task makes its own starting model

    def wm_train(out: Path, kill_at: str = "") -> int:
        text_only = ("actor_rollout_ref.model.path=", "task.val_size=")
        argv = [a for a in overrides(out, model, *extra) if not a.startswith(text_only)]
        env = {**os.environ, KILL_ENV: kill_at}
        cmd = [sys.executable, "-m", "mmrl.trainer.cli", "train", *argv]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode in (0, -9), proc.stderr[-3000:]
        return proc.returncode

    assert wm_train(full) == 0
    assert wm_train(resumed, kill_at="after_step:3") == -9
    assert wm_train(resumed) == 0
    assert (resumed / "global_step_4" / "actor" / "latent_policy.json").is_file()
    assert_same_run(resumed, full)
