"""The runner: composition, failure isolation (raise, hang, crash, NaN), logging, overlap, Ray,
fit."""

from __future__ import annotations

import logging
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl.protocol import Batch
from mmrl.verifiers import (
    VERIFIERS,
    VerifierOutput,
    VerifierOutputError,
    VerifierRunner,
    register_verifier,
)

# Faulty verifiers keyed on the prompt index in ``uid`` ("<step>-<prompt>"), as the fit loop sets
# it.
FAULTY = '''
import math, os, time
import numpy as np
from mmrl.verifiers import verifier

def prompt_index(batch):
    return [int(str(u).split("-")[1]) for u in batch["uid"]]

def raises(batch):
    """Raises when a prompt index divisible by 4 is in the batch."""
    if any(i % 4 == 0 for i in prompt_index(batch)):
        raise RuntimeError("boom")
    return [1.0] * len(batch)

def returns_nan(batch):
    return [math.nan if i % 4 == 2 else (math.inf if i == 7 and len(batch) == 99 else 0.25) for i in
    prompt_index(batch)]

@verifier(mode="process", timeout_s=1.0)
def hangs(batch):
    """Never returns for prompt 1."""
    if 1 in prompt_index(batch):
        time.sleep(3600)
    return [0.5] * len(batch)

@verifier(mode="process", timeout_s=20.0, chunk_size=4)
def crashes(batch):
    """Kills its worker process for prompt 3; scored in chunks of 4 samples."""
    if 3 in prompt_index(batch):
        os._exit(3)
    return np.array([float(i) for i in prompt_index(batch)])

@verifier(mode="process", timeout_s=20.0)
def raises_in_worker(batch):
    if 5 in prompt_index(batch):
        raise ValueError("bad sample")
    return [2.0] * len(batch)
'''


@pytest.fixture
def faulty(tmp_path) -> Path:
    path = tmp_path / "faulty.py"
    path.write_text(textwrap.dedent(FAULTY))
    return path


def uid_batch(prompts: int = 8, n: int = 2, **tensors) -> Batch:
    uids = [f"1-{i}" for i in range(prompts) for _ in range(n)]
    return Batch.from_dict(
        tensors or None,
        {"uid": uids, "response_text": ["x"] * len(uids), "ground_truth": ["x"] * len(uids)},
    )


# ----- batch mode ----------------------------------------------------------------------------


def test_weighted_sum_with_negative_weights_matches_the_parts():
    """-(mae + mse) + 0.5 psnr, the composition a frame-prediction reward uses."""
    rng = np.random.default_rng(0)
    gt = torch.from_numpy(rng.random((4, 2, 16, 16, 3), dtype=np.float32))
    pred = (gt + 0.1 * torch.randn_like(gt)).clamp(0, 1)
    batch = Batch.from_dict({"pred_frames": pred, "gt_frames": gt})
    with VerifierRunner([("mae", -1.0), ("mse", -1.0), ("psnr", 0.5)]) as runner:
        out = runner.run(batch)
    parts = {
        name: VerifierRunner([(name, 1.0)]).run(batch).scores for name in ("mae", "mse", "psnr")
    }
    np.testing.assert_allclose(out.scores, -parts["mae"] - parts["mse"] + 0.5 * parts["psnr"])
    assert out.valid.all() and out.metrics["reward/invalid_rate"] == 0.0
    assert out.metrics["reward/psnr/mean"] == pytest.approx(parts["psnr"].mean())
    for name in ("mae", "mse", "psnr"):
        assert out.metrics[f"timing_s/reward/{name}"] > 0
        assert out.metrics[f"reward/{name}/errors"] == 0


def test_batched_call_that_raises_falls_back_to_per_sample_calls(faulty, caplog):
    runner = VerifierRunner([("exact_answer", 1.0), (f"{faulty}:raises", 0.5)])
    with caplog.at_level(logging.WARNING, logger="mmrl.verifiers.runner"):
        out = runner.run(uid_batch())
        runner.run(uid_batch())
    bad = np.array([int(u.split("-")[1]) % 4 == 0 for u in uid_batch()["uid"]])
    assert out.valid.tolist() == (~bad).tolist()
    np.testing.assert_allclose(out.scores, np.where(bad, 0.0, 1.5))
    assert out.metrics["reward/raises/errors"] == bad.sum() == 4
    assert out.metrics["reward/raises/errors/raise"] == 4
    assert out.metrics["reward/invalid_rate"] == 0.25
    first = [r.message for r in caplog.records if "raise on sample" in r.message]
    assert (
        len(first) == 1 and "sample 0, uid '1-0'" in first[0] and "RuntimeError: boom" in first[0]
    )


@pytest.fixture
def registry():
    """Verifiers a test registers are removed after it, so the test can run again in-process."""
    before = set(VERIFIERS)
    yield
    for name in set(VERIFIERS) - before:
        del VERIFIERS[name]


def test_nan_and_declared_invalid_mark_samples_but_only_nan_counts_as_error(faulty, registry):
    @register_verifier("test_runner_declares_invalid")
    def declares_invalid(batch: Batch) -> VerifierOutput:
        return VerifierOutput(
            np.ones(len(batch)), np.arange(len(batch)) != 1, {"seen": np.full(len(batch), 2.0)}
        )

    runner = VerifierRunner([(f"{faulty}:returns_nan", 1.0), ("test_runner_declares_invalid", 1.0)])
    out = runner.run(uid_batch())
    nan_rows = [i for i, u in enumerate(uid_batch()["uid"]) if int(u.split("-")[1]) % 4 == 2]
    assert out.metrics["reward/returns_nan/errors/nonfinite"] == len(nan_rows) == 4
    assert out.metrics["reward/test_runner_declares_invalid/errors"] == 0
    assert out.metrics["reward/test_runner_declares_invalid/seen"] == 2.0
    assert sorted(np.flatnonzero(~out.valid).tolist()) == sorted([1, *nan_rows])
    assert np.isfinite(out.scores).all()


def test_zero_weight_verifier_is_reported_but_does_not_invalidate(faulty):
    out = VerifierRunner([("exact_answer", 1.0), (f"{faulty}:raises", 0.0)]).run(uid_batch())
    assert out.valid.all() and out.metrics["reward/raises/errors"] == 4


def test_wrong_number_of_scores_is_a_bug_and_raises(registry):
    register_verifier("test_runner_one_score")(lambda batch: [1.0])
    with pytest.raises(VerifierOutputError, match=r"returned 1 scores .* batch of 16"):
        VerifierRunner([("test_runner_one_score", 1.0)]).run(uid_batch())


def test_submit_overlaps_and_ignores_fields_added_meanwhile():
    batch = uid_batch()
    with VerifierRunner([("exact_answer", 1.0), ("format", 1.0)]) as runner:
        future = runner.submit(batch)
        batch["old_log_probs"] = torch.zeros(len(batch), 3)  # what the trainer does while verifying
        out = future.result(timeout=30)
        np.testing.assert_array_equal(out.scores, runner.run(batch).scores)


# ----- process mode ----------------------------------------------------------------------------


@pytest.mark.slow  # starting the worker processes costs ~5-10 s (they import torch + tensordict)
def test_process_mode_isolates_hangs_crashes_and_raises(faulty, caplog):
    """One run: hangs time out, a worker crash only fails its samples, chunks are retried per
    sample.
    """
    specs = [
        ("exact_answer", 1.0),
        (f"{faulty}:hangs", 1.0),
        (f"{faulty}:crashes", 0.01),
        (f"{faulty}:raises_in_worker", 1.0),
    ]
    with VerifierRunner(specs, num_workers=2) as runner, caplog.at_level(logging.WARNING):
        out = runner.run(uid_batch(prompts=8, n=2))
    prompt = np.array([int(u.split("-")[1]) for u in uid_batch()["uid"]])
    m = out.metrics
    assert m["reward/hangs/errors/timeout"] == 2  # prompt 1, two samples
    assert m["reward/crashes/errors/crash"] == 2  # prompt 3; the rest of its chunk was retried
    assert m["reward/raises_in_worker/errors/raise"] == 2  # prompt 5
    assert out.valid.tolist() == (~np.isin(prompt, [1, 3, 5])).tolist()
    ok = out.valid
    np.testing.assert_allclose(out.scores[ok], 1.0 + 0.5 + 0.01 * prompt[ok] + 2.0)
    assert m["reward/invalid_rate"] == 6 / 16
    assert m["timing_s/reward/hangs"] >= 2 * 1.0  # two calls ran into the 1 s timeout
    assert any("timeout on sample 2, uid '1-1'" in r.message for r in caplog.records)


@pytest.mark.slow
def test_process_mode_runs_on_ray_actors_when_ray_is_initialised(faulty):
    import ray

    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20
    )
    try:
        specs = [(f"{faulty}:hangs", 1.0), (f"{faulty}:raises_in_worker", 1.0)]
        out = VerifierRunner(specs).run(uid_batch(prompts=6, n=1))
    finally:
        ray.shutdown()
    assert out.metrics["reward/hangs/errors/timeout"] == 1
    assert out.metrics["reward/raises_in_worker/errors/raise"] == 1
    assert out.valid.tolist() == [True, False, True, True, True, False]
    np.testing.assert_allclose(out.scores[out.valid], 2.5)


# ----- a real GRPO run with faulty verifiers -----------------------------------------------------


@pytest.mark.slow
def test_grpo_run_with_raising_hanging_and_nan_verifiers_finishes_with_right_invalid_counts(
    tmp_path, faulty, caplog
):
    """8 prompts x 4 samples per step: prompts 0, 4 raise, 1 hangs, 2, 6 give NaN -> 20 of 32
    invalid.
    """
    from mmrl.config import load_config
    from mmrl.trainer.fit import fit

    verifiers = (
        "[{name: exact_answer, weight: 1.0},"
        f" {{name: '{faulty}:raises', weight: 0.1}},"
        f" {{name: '{faulty}:hangs', weight: 0.1}},"
        f" {{name: '{faulty}:returns_nan', weight: 0.1}}]"
    )
    cfg = load_config(
        [
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.progress_bar=false",
            "trainer.loggers=[jsonl]",
            "trainer.total_steps=3",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "task.sft.steps=20",
            "task.train_size=64",
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            f"reward.verifiers={verifiers}",
        ]
    )
    with caplog.at_level(logging.WARNING, logger="mmrl.verifiers.runner"):
        result = fit(cfg)
    assert len(result.history) == 3
    for row in result.history:
        assert row["reward/raises/errors/raise"] == 8
        assert row["reward/hangs/errors/timeout"] == 4
        assert row["reward/returns_nan/errors/nonfinite"] == 8
        assert row["reward/exact_answer/errors"] == 0
        assert row["reward/invalid_rate"] == pytest.approx(20 / 32)
        assert math.isfinite(row["actor/pg_loss"])
        assert row["timing_s/reward/hangs"] >= 4 * 1.0
    for kind in ("raise on sample", "timeout on sample", "nonfinite on sample"):
        assert sum(kind in r.message for r in caplog.records) == 1, (
            kind
        )  # logged once, not per step
