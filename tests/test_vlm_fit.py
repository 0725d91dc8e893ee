"""VLM tasks in the one fit loop: GRPO learns visual comparison, users' parquet trains, eval
scores.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mmrl.config import load_config
from mmrl.data import write_vision_parquet
from mmrl.models.tiny_vlm import build_tiny_qwen2_vl
from mmrl.tasks import get_task
from mmrl.tasks.visual_counting import VisualCountingConfig, make_counting_dataset
from mmrl.trainer import cli
from mmrl.trainer.eval_split import checkpoint_scores
from mmrl.trainer.fit import fit
from tests.conftest import assert_rollout_matches_actor, run_overrides
from tests.paired import paired_gain

# The short fixed-seed version of `mmrl train task=visual_comparison` (benchmarks/bench_vlm_grpo.py
# runs the full 40 steps over several seeds). Budget fixed before RL: 150 SFT steps of 32.
SHORT_COMPARISON = (
    "task=visual_comparison",
    "trainer.total_steps=20",
    "trainer.test_freq=20",
    "task.val_size=128",
    "trainer.val_greedy=false",
)
# Counting asserts the warm-up and rollout/training agreement, not an RL gain (see the test),
# so a few GRPO steps are enough.
SHORT_COUNTING = ("task=visual_counting", "trainer.total_steps=4", "trainer.test_freq=4")


def counting_parquet(path, n: int, seed: int):
    data = make_counting_dataset(VisualCountingConfig(), n, seed)
    return write_vision_parquet(path, data.problems, data.ground_truth, data.images)


@pytest.mark.slow
def test_grpo_beats_its_warm_start_on_visual_comparison_test_images(tmp_path):
    """SFT warm-up then GRPO on a tiny Qwen2-VL. The warm-up model and the RL actor answer the
    same 256 test images (held out from training and validation), 4 samples each at
    temperature 1 with the same seeds; RL must win by at least 3 standard errors of the
    paired per-image difference. Rollout and training must agree."""
    cfg = load_config(run_overrides(tmp_path, *SHORT_COMPARISON, "task.test_size=256"))
    result = fit(cfg)
    assert result.history[0]["sft/steps"] == 150
    assert_rollout_matches_actor(result.series, cfg.trainer.mixed_precision)
    test = get_task("visual_comparison")(cfg.task).build_data(cfg.trainer.seed).test
    scores = {
        name: checkpoint_scores(tmp_path / name, cfg, test, samples=4, do_sample=True).mean(1)
        for name in ("init_model", "actor")
    }
    gain, se = paired_gain(scores["init_model"], scores["actor"], "visual comparison, test")
    assert gain > 0 and gain >= 3 * se, (gain, se)


# Bench tier (CI's time budget): docs/benchmarks.md runs this recipe over seeds.
@pytest.mark.bench
def test_visual_counting_sft_then_grpo(tmp_path):
    """SFT warm-up then 4 GRPO steps, end to end: on 512 test images (drawn apart from training
    and validation) the warm-up's greedy answers count above chance (1 in 5) by at least 3
    binomial standard errors at chance; held-out accuracy is measured before and after RL;
    rollout and training agree.

    GRPO does not reliably raise counting accuracy at this budget (docs/benchmarks.md), so
    this test does not assert a rise; the visual comparison test above asserts RL's gain.
    """
    cfg = load_config(run_overrides(tmp_path, *SHORT_COUNTING, "task.test_size=512"))
    result = fit(cfg)
    assert len(result.series("val/math_answer/mean")) == 2
    assert result.history[0]["sft/steps"] == 600
    assert_rollout_matches_actor(result.series, cfg.trainer.mixed_precision)
    test = get_task("visual_counting")(cfg.task).build_data(cfg.trainer.seed).test
    # The score is math_answer (1 when the count is right) + 0.1 x format.
    scores = checkpoint_scores(tmp_path / "init_model", cfg, test)
    chance, n = 0.2, len(scores)
    se = float(np.sqrt(chance * (1 - chance) / n))
    accuracy = float(np.mean(scores >= 1.0))
    print(f"visual counting, SFT warm-up on {n} test images: accuracy {accuracy:.3f}, "
          f"chance {chance}, {(accuracy - chance) / se:.1f} SE above it")  # fmt: skip
    assert accuracy - chance >= 3 * se, (accuracy, se)


def parquet_run(tmp_path, *extra: str):
    """A user's setup: a tiny Qwen2-VL checkpoint and train/val parquet files; returns (config, val
    file).
    """
    model = build_tiny_qwen2_vl(
        tmp_path / "model", seed=0, min_pixels=112 * 112, max_pixels=112 * 112
    )
    train = counting_parquet(tmp_path / "train.parquet", 8, seed=0)
    val = counting_parquet(tmp_path / "val.parquet", 4, seed=1)
    cfg = load_config(
        run_overrides(
            tmp_path / "run",
            "task=vision_parquet",
            f"actor_rollout_ref.model.path={model}",
            f"task.train_files=[{train}]",
            f"task.val_files=[{val}]",
            "data.train_batch_size=4",
            "data.max_prompt_length=128",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.freeze_modules=['visual\\.']",
            *extra,
        )
    )
    return cfg, val


def test_vision_parquet_trains_and_eval_prints_accuracy(tmp_path, capsys):
    """A user's parquet and checkpoint: `mmrl train task=vision_parquet`, then `mmrl eval
    --parquet`; the old `mmrl eval-vlm` names the new command."""
    cfg, val = parquet_run(tmp_path, "trainer.total_steps=2", "trainer.test_freq=2")
    result = fit(cfg)
    assert len(result.series("val/math_answer/mean")) == 2
    assert np.isfinite(result.series("actor/pg_loss")).all()

    out = tmp_path / "eval.json"
    assert (
        cli.main(
            [
                "eval",
                "--checkpoint",
                str(tmp_path / "run" / "actor"),
                "--parquet",
                str(val),
                "--max-prompt-length",
                "128",
                "--max-response-length",
                "8",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "accuracy:" in printed and "/4, math_answer, greedy decoding" in printed
    report = json.loads(out.read_text())
    assert report["num_samples"] == 4 and 0.0 <= report["accuracy"] <= 1.0
    old = ["eval-vlm", "--checkpoint", str(tmp_path / "run" / "actor"), "--parquet", str(val)]
    assert cli.main(old) == 2
    assert "mmrl eval --checkpoint DIR --parquet FILE" in capsys.readouterr().err


@pytest.mark.slow
def test_vision_parquet_through_two_ray_workers(tmp_path):
    """The same run on the Ray hybrid engine: two FSDP workers, each with half of every VLM
    Batch."""
    cfg, _ = parquet_run(
        tmp_path,
        "trainer.total_steps=2",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.n_workers_per_node=2",
        "trainer.ray_object_store_mb=512",
        "trainer.dist_timeout_s=120",
    )
    result = fit(cfg)
    assert np.isfinite(result.series("actor/pg_loss")).all()
    assert_rollout_matches_actor(result.series, cfg.trainer.mixed_precision)


def test_eval_vlm_names_a_bad_column(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmrl.data import ParquetSchemaError

    model = build_tiny_qwen2_vl(tmp_path / "model")
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["<image>hi"], "answer": ["1"]}), bad)
    argv = ["eval", "--checkpoint", str(model), "--parquet", str(bad)]
    assert cli.main(argv) == 1  # a DataError: one line, no traceback
    assert "missing column 'problem'" in capsys.readouterr().err
    with pytest.raises(ParquetSchemaError, match="missing column 'problem'"):
        cli.main(["--debug", *argv])
