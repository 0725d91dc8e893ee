"""Validation @N: verl's mean/best/worst/maj@N with bootstrap std (checked against every
possible resample of small groups), the frame strip, reward.val_verifiers, and the per-stage
timing, throughput and memory metrics of a real run."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from mmrl.config import load_config
from mmrl.protocol import Batch
from mmrl.trainer.fit import fit
from mmrl.trainer.val_metrics import (
    majority_values,
    prompt_metrics,
    subset_sizes,
    validation_metrics,
)
from mmrl.trainer.validation import STRIP_SCALE, frame_strip
from mmrl.verifiers import VERIFIERS, register_verifier
from tests.conftest import run_overrides


def reference_majority(values: list[float], answers: list[str]) -> float:
    """verl's rule, written plainly: the answer with the most votes, the first seen on a tie;
    the value of its first sample."""
    counts = Counter(answers)  # keeps first-seen order
    top = max(counts.values())
    winner = next(a for a in counts if counts[a] == top)
    return values[answers.index(winner)]


def exact_stats(values, answers, k) -> dict[str, tuple[float, float]]:
    """Mean and std of best/worst/maj over every one of the n**k equally likely resamples."""
    per = {"best": [], "worst": [], "maj": []}
    for draw in itertools.product(range(len(values)), repeat=k):
        vals = [values[i] for i in draw]
        per["best"].append(max(vals))
        per["worst"].append(min(vals))
        per["maj"].append(reference_majority(vals, [answers[i] for i in draw]))
    return {name: (float(np.mean(v)), float(np.std(v))) for name, v in per.items()}


def test_subset_sizes_are_verls():
    assert subset_sizes(1) == [] and subset_sizes(2) == [2]
    assert subset_sizes(5) == [2, 4, 5] and subset_sizes(8) == [2, 4, 8]


def test_majority_vote_and_its_ties():
    values = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0], [0.3, 0.7, 0.7]])
    answers = np.array([[0, 1, 1], [2, 5, 5], [4, 9, 4]])
    assert majority_values(values, answers).tolist() == [0.0, 1.0, 0.3]
    tie = majority_values(np.array([[0.0, 1.0, 1.0, 0.0]]), np.array([[7, 3, 3, 7]]))
    assert tie.tolist() == [0.0]  # 7 and 3 have two votes each; 7 comes first
    for row_values, row_answers in zip(values, answers, strict=True):
        assert majority_values(row_values[None], row_answers[None])[0] == reference_majority(
            row_values.tolist(), [str(a) for a in row_answers]
        )


@pytest.mark.parametrize(
    ("values", "answers"),
    [
        ([1.0, 0.0, 0.0], ["7", "3", "3"]),  # the right answer is the minority
        ([0.0, 1.0, 1.0, 0.25], ["x", "y", "y", "z"]),
    ],
)
def test_bootstrap_matches_every_possible_resample(values, answers):
    n, draws = len(values), 40_000
    codes = np.unique(answers, return_inverse=True)[1]
    got = prompt_metrics(np.array(values), codes, seed=0, n_bootstrap=draws)
    assert got[f"mean@{n}"] == pytest.approx(np.mean(values), abs=1e-12)
    assert got[f"std@{n}"] == pytest.approx(np.std(values), abs=1e-12)
    for k in subset_sizes(n):
        for name, (mean, std) in exact_stats(values, answers, k).items():
            # 5 standard errors of a mean over `draws` resamples
            assert got[f"{name}@{k}/mean"] == pytest.approx(mean, abs=5 * std / draws**0.5 + 1e-12)
            assert got[f"{name}@{k}/std"] == pytest.approx(std, abs=0.02)


def test_one_sample_per_prompt_gives_mean_at_1_only():
    assert prompt_metrics(np.array([0.5]), None, seed=0) == {"mean@1": 0.5}
    out = validation_metrics(["t", "t"], [0, 1], {"reward": np.array([1.0, 0.0])})
    assert out == {"val-core/t/reward/mean@1": 0.5}


def test_core_and_aux_keys_and_the_average_over_prompts():
    # Two prompts of 4 samples: the first mostly answers "2" (wrong), once "4" (right).
    rewards = np.array([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    answers = ["2", "2", "4", "2", "4", "4", "4", "4"]
    fmt = np.ones(8)
    out = validation_metrics(
        ["add"] * 8, [0, 0, 0, 0, 1, 1, 1, 1], {"reward": rewards, "format": fmt}, answers
    )
    core = {k.removeprefix("val-core/add/reward/") for k in out if k.startswith("val-core/")}
    assert core == {"mean@4", "best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std"}
    assert out["val-core/add/reward/mean@4"] == pytest.approx((0.25 + 1.0) / 2)
    assert out["val-aux/add/reward/std@4"] == pytest.approx((np.std([0, 0, 1, 0]) + 0) / 2)
    for aux in ("worst@4/mean", "best@2/mean", "maj@2/std", "worst@2/std"):
        assert f"val-aux/add/reward/{aux}" in out
    # Majority voting follows the wrong answer of prompt 0; best-of-4 finds the right one.
    assert out["val-core/add/reward/maj@4/mean"] < out["val-core/add/reward/mean@4"]
    assert out["val-core/add/reward/best@4/mean"] > out["val-core/add/reward/mean@4"]
    assert out["val-aux/add/format/mean@4"] == 1.0 and "val-core/add/format/mean@4" not in out
    without_answers = validation_metrics(["add"] * 8, [0] * 4 + [1] * 4, {"reward": rewards})
    assert not any("maj@" in k for k in without_answers)


def test_frame_strip_shows_context_truth_and_prediction():
    h, w = 2, 3
    gt = torch.zeros(4, 2, h, w, 3, dtype=torch.uint8)  # 2 prompts x n=2 samples, F=2
    gt[..., 0] = 200
    pred = torch.full((4, 2, h, w, 3), 0.0)
    pred[0, 1] = float("nan")  # an undecodable frame shows grey
    context = torch.full((4, h, w, 3), 50, dtype=torch.uint8)
    batch = Batch.from_dict(
        tensors={"gt_frames": gt, "pred_frames": pred, "last_context_frame": context}
    )
    image = frame_strip(batch, n=2)
    s = STRIP_SCALE
    row_width = w + 2 + 2 * w + 2 + 2 * w  # context | gap | truth | gap | prediction
    assert image.shape == (s * (2 * h + 2), s * row_width, 3) and image.dtype == np.uint8
    first = image[: s * h : s, ::s]
    assert (first[:, :w] == 50).all() and (first[:, w : w + 2] == 255).all()
    assert (first[:, w + 2 : 3 * w + 2, 0] == 200).all()
    assert (first[:, 3 * w + 4 : 4 * w + 4] == 0).all()
    assert (first[:, 4 * w + 4 :] == 128).all()
    assert (image[s * h : s * (h + 2)] == 255).all()  # the gap between prompts


@pytest.fixture
def always_one():
    name = "always_one_for_validation"
    register_verifier(name)(lambda batch: np.ones(len(batch)))
    yield name
    VERIFIERS.pop(name, None)


def test_val_verifiers_score_validation_at_n_and_every_stage_is_timed(
    tmp_path, tiny_lm_dirs, always_one
):
    """Training scores with exact_answer; validation with a verifier that always gives 1 (and
    exact_answer at weight 0, reported but not summed), 4 samples per prompt."""
    cfg = load_config(
        run_overrides(
            tmp_path,
            f"actor_rollout_ref.model.path={tiny_lm_dirs['untied']}",
            "trainer.total_steps=2",
            "trainer.test_freq=2",
            "trainer.save_freq=1",
            "data.train_batch_size=4",
            "data.val_batch_size=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.val_kwargs.n=4",
            f"reward.val_verifiers=[{{name: {always_one}, weight: 1.0}},"
            "{name: exact_answer, weight: 0.0}]",
            "task.val_size=8",
            "reward.overlong_reward=keep",  # a random model rarely stops
        )
    )
    result = fit(cfg)
    first, step1, step2 = result.history
    for row in (first, step2):
        assert row["val/score/mean"] == 1.0
        assert row["val-core/text_addition/reward/mean@4"] == 1.0
        assert row["val-core/text_addition/reward/maj@4/mean"] == 1.0
        assert row["val-aux/text_addition/exact_answer/mean@4"] == pytest.approx(
            row["val/exact_answer/mean"]
        )
    assert max(result.series("critic/score/mean")) < 1.0  # training reads exact_answer
    assert "val/score/mean" not in step1

    # old_log_prob is its own stage only where the update cannot reuse its forward pass
    stages = ("gen", "reward", "ref", "adv", "update_actor", "update_weights")
    for row in (step1, step2):
        assert all(row[f"timing_s/{s}"] > 0 for s in stages)
        assert row["perf/max_memory_gib"] == row["perf/max_rss_gib"] > 0.1
        tokens_per_sample = row["perf/total_num_tokens"] / (4 * 2)
        assert row["perf/throughput"] / row["perf/samples_per_s"] == pytest.approx(
            tokens_per_sample
        )
    assert step1["timing_s/save_checkpoint"] > 0 and "timing_s/testing" not in step1
    # the last step validates and, like every run's last step, saves a checkpoint
    assert step2["timing_s/testing"] > 0 and step2["timing_s/save_checkpoint"] > 0
    for row in (step1, step2):  # the step's time includes validation and the checkpoint
        parts = (*stages, "old_log_prob", "testing", "save_checkpoint")
        inner = sum(row.get(f"timing_s/{s}", 0.0) for s in parts)
        assert row["timing_s/step"] >= inner - row["timing_s/update_weights"]
    assert (tmp_path / "global_step_1" / "actor").is_dir()
