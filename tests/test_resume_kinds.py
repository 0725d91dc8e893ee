"""Exact resume for the other kinds of run: a token world model, a VLM on a user's parquet
and checkpoint, and a vLLM engine. Each run is a real `mmrl train`
process, SIGKILLed after step 3 and run again; every later metric except machine
measurements must equal the uninterrupted run's bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_overrides
from tests.test_checkpoint import comparable
from tests.test_resume_exact import KEYS, history, overrides

KILL_ENV = "MMRL_TEST_KILL_AT"
SCHEDULE = ("trainer.total_steps=5", "trainer.save_freq=2", "trainer.test_freq=2")


def train(out: Path, *extra: str, kill_at: str = "") -> int:
    argv = [sys.executable, "-m", "mmrl.trainer.cli", "train", *run_overrides(out, *extra)]
    env = {**os.environ, KILL_ENV: kill_at}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, -9), proc.stderr[-3000:]
    return proc.returncode


def assert_resumes_exactly(tmp_path: Path, *extra: str, val_key: str) -> Path:
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    assert train(full, *extra) == 0
    assert train(resumed, *extra, kill_at="after_step:3") == -9
    assert (resumed / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    assert train(resumed, *extra) == 0
    a, b = comparable(history(resumed)), comparable(history(full))
    assert list(a) == list(b) == [0, 1, 2, 3, 4, 5]
    assert all(key in b[5] for key in KEYS[1:]) and val_key in b[4]
    assert a == b
    return resumed


# Bench tier (CI's time budget): a token world model's checkpoint is a text LM's plus its fixed
# tokenizer, whose resume the other kinds here and test_resume_exact.py cover.
@pytest.mark.bench
def test_token_world_model_run_killed_between_steps_continues_exactly(tmp_path):
    pre = "++task.pretrain."
    resumed = assert_resumes_exactly(
        tmp_path,
        "task=worldmodel_tokens",
        f"task.cache_dir={tmp_path / 'cache'}",  # shared: pretraining is made once
        f"{pre}data.train_trajectories=24",
        f"{pre}data.val_trajectories=4",
        f"{pre}data.test_trajectories=4",
        f"{pre}data.length=8",
        f"{pre}tokenizer.train.steps=20",
        f"{pre}tokenizer.train.batch_size=8",
        f"{pre}train.steps=20",
        f"{pre}train.val_every=20",
        f"{pre}train.val_windows=8",
        f"{pre}train.eval_windows=8",
        f"{pre}progress_bar=false",
        "task.val_windows=8",
        "task.eval.windows=8",
        "task.eval.samples=1",
        "task.report=false",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        *SCHEDULE,
        val_key="val/psnr/mean",
    )
    # What the world model needs to continue sits in the checkpoint beside the weights.
    assert (resumed / "global_step_4" / "actor" / "config.json").is_file()


@pytest.mark.slow
def test_vlm_run_on_a_users_parquet_killed_between_steps_continues_exactly(tmp_path):
    from mmrl.models.tiny_vlm import build_tiny_qwen2_vl
    from tests.test_vlm_fit import counting_parquet

    model = build_tiny_qwen2_vl(tmp_path / "model", seed=0, min_pixels=112**2, max_pixels=112**2)
    train_file = counting_parquet(tmp_path / "train.parquet", 8, seed=0)
    val_file = counting_parquet(tmp_path / "val.parquet", 4, seed=1)
    resumed = assert_resumes_exactly(
        tmp_path,
        "task=vision_parquet",
        f"actor_rollout_ref.model.path={model}",
        f"task.train_files=[{train_file}]",
        f"task.val_files=[{val_file}]",
        "data.train_batch_size=4",
        "data.max_prompt_length=128",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.freeze_modules=['visual\\.']",
        *SCHEDULE,
        val_key="val/math_answer/mean",
    )
    # The processor files travel with the checkpoint, so it loads on its own.
    assert (resumed / "global_step_4" / "actor" / "processor_config.json").is_file()


@pytest.mark.slow
def test_vllm_engine_run_resumes_exactly(tmp_path, warm_model_dir):
    """The engine samples each row with the row's own seed, and the loaded weights are synced
    into it before the first rollout: a vLLM run resumes exactly too. (Two workers' engines
    following every update is tests/test_hybrid_ray.py's; rows keep their seeds on any rank,
    which the 2-worker resume tests of tests/test_resume_exact.py show.)"""
    extra = overrides(
        tmp_path / "unused",
        warm_model_dir,
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.kv_cache_memory_gib=0.125",
    )
    extra = [a for a in extra if not a.startswith(("trainer.output_dir=", "trainer.progress"))]
    extra = [a for a in extra if not a.startswith("trainer.loggers=")]
    assert_resumes_exactly(tmp_path, *extra, val_key="val/score/mean")
