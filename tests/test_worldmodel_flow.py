"""`mmrl train task=worldmodel_flow` end to end with tiny budgets: flow-matching pretraining,
GRPO over denoising steps through the one fit loop, and the test-split comparison."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import run_overrides

TINY = (
    "task=worldmodel_flow",
    "task.train_trajectories=12",
    "task.val_trajectories=4",
    "task.test_trajectories=4",
    "task.length=8",
    "task.autoencoder_train.steps=20",
    "task.pretrain.steps=30",
    "task.pretrain.val_every=30",
    "task.val_windows=8",
    "task.eval.windows=8",
    "task.sampler.num_steps=4",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "trainer.total_steps=2",
    "trainer.test_freq=2",
)


@pytest.mark.slow
def test_train_worldmodel_flow_runs_steps_and_writes_the_test_comparison(tmp_path):
    from mmrl.config import load_config
    from mmrl.trainer.fit import fit

    out = tmp_path / "run"
    cfg = load_config(run_overrides(out, *TINY, f"task.work_dir={tmp_path / 'work'}"))
    result = fit(cfg)
    row = result.history[-1]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm",
                "val/score/mean", "val/lpips/mean", "val/greedy/score/mean"):  # fmt: skip
        assert np.isfinite(row[key]), key
    assert row["response_length/mean"] == 2 * 3  # F frames x (S - 1) stochastic steps
    assert max(result.series("rollout/logprob_diff_max")) < 1e-4
    saved = out / "actor"
    assert json.loads((saved / "flow_policy.json").read_text())["num_steps"] == 4
    assert (saved / "autoencoder" / "config.json").is_file()
    table = json.loads((out / "worldmodel_eval.json").read_text())
    for model in ("base", "rl"):
        for decoding in ("greedy", "sampled"):
            assert np.isfinite(table[model][decoding]["lpips"]), (model, decoding)


@pytest.mark.slow
def test_train_worldmodel_flow_on_two_ray_fsdp_workers(tmp_path):
    """The same run on two Ray workers: each rank samples its share of the denoising paths and
    FSDP2 shards the velocity model; the recomputed log-probs still match the rollout's."""
    from mmrl.config import load_config
    from mmrl.trainer.fit import fit

    out = tmp_path / "run"
    cfg = load_config(
        run_overrides(
            out,
            *TINY,
            f"task.work_dir={tmp_path / 'work'}",
            "trainer.n_workers_per_node=2",
            "trainer.total_steps=1",
            "trainer.test_freq=1",
        )
    )
    row = fit(cfg).history[-1]
    for key in ("actor/pg_loss", "actor/kl_loss", "val/score/mean"):
        assert np.isfinite(row[key]), key
    assert row["rollout/logprob_diff_max"] < 1e-4
    assert (out / "worldmodel_eval.json").is_file()
