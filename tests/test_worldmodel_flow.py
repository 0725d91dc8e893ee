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


@pytest.mark.slow
def test_flow_world_model_on_recorded_videos_through_the_cli(tmp_path, capsys):
    """`mmrl train task=worldmodel_flow_videos` on 12 tiny 48x64 mp4 episodes with 3-dim
    actions: import by episode (the folder stays read-only and unchanged), the autoencoder at
    the videos' resolution, flow matching, GRPO, the test comparison with its references; then
    `mmrl eval` on the RL folder against the recordings."""
    import os
    import stat

    from mmrl.trainer.cli import main
    from tests.video_data import write_episodes

    videos = write_episodes(tmp_path / "videos", 12, t=10)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in videos.iterdir())
    run = tmp_path / "run"
    tiny = [o for o in TINY[1:] if "trajectories" not in o and "length" not in o]
    os.chmod(videos, stat.S_IRUSR | stat.S_IXUSR)
    try:
        code = main(
            ["train", "task=worldmodel_flow_videos", f"task.data.videos={videos}",
             f"task.work_dir={tmp_path / 'work'}", *run_overrides(run, *tiny),
             "task.autoencoder.block_out_channels=[8,16,16]", "task.autoencoder.norm_num_groups=4"]
        )  # fmt: skip
    finally:
        os.chmod(videos, stat.S_IRWXU)
    assert code == 0
    assert sorted((p.name, p.stat().st_mtime_ns) for p in videos.iterdir()) == before
    saved = json.loads((run / "actor" / "flow_policy.json").read_text())
    assert saved["action_dim"] == 3  # the sidecars' columns
    ae = json.loads((run / "actor" / "autoencoder" / "config.json").read_text())
    assert ae["sample_size"] == [48, 64]
    table = json.loads((run / "worldmodel_eval.json").read_text())
    assert set(table) == {"base", "rl", "reference"}
    for model in ("base", "rl"):
        for decoding in ("greedy", "sampled"):
            m = table[model][decoding]
            assert all(np.isfinite(m[k]) for k in ("psnr", "lpips", "psnr@t2")), (model, m)
            assert np.isnan(m.get("state_match", np.nan))  # recordings have no state to read
    assert np.isfinite(table["reference"]["copy last context frame (through the AE)"]["lpips"])
    capsys.readouterr()
    assert main(["eval", "--model", str(run / "actor"), "--data", str(videos),
                 "--windows", "4", "--samples", "1"]) == 0  # fmt: skip
    assert "flow-matching latent policy; 4 windows" in capsys.readouterr().out
