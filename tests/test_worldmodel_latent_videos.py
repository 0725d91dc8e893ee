"""The latent world model on recorded videos: import by episode under the work folder,
windows of episodes of any length, non-square latents, the data's action dimension, and
one-line errors for bad input (the token route's checks)."""

import json
import os
import stat

import numpy as np
import pytest
import torch

from mmrl.config import load_config
from mmrl.processors.latent import LatentWorldModelProcessor
from mmrl.tasks import get_task
from mmrl.worldmodel.latent_ae import AEConfig, LatentAutoencoder, build_ae_model
from mmrl.worldmodel.video import write_mp4
from tests.video_data import square_episode, write_episodes


def listing(folder):
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir())


def latent_task(tmp_path, videos, *extra, name="worldmodel_latent_videos", work=None):
    cfg = load_config(
        [f"task={name}", f"task.data.videos={videos}", f"task.work_dir={work or tmp_path / 'work'}",
         "trainer.progress_bar=false", *extra]
    )  # fmt: skip
    return get_task(cfg.task["name"])(cfg.task), cfg


def test_videos_are_imported_by_episode_into_the_work_folder(tmp_path):
    videos = write_episodes(tmp_path / "videos", 5, t=8)
    frames, actions = square_episode(np.random.default_rng(9), t=11)  # a longer episode
    write_mp4(videos / "ep05.mp4", frames, fps=10)
    np.save(videos / "ep05.npy", actions)
    before = listing(videos)
    os.chmod(videos, stat.S_IRUSR | stat.S_IXUSR)  # a-w: any write there would fail
    try:
        task, _ = latent_task(tmp_path, videos, "task.data.val_fraction=0.2")
        train, val, test = task.data_dirs()
        data = task.build_data(seed=0)
        policy = task.policy_config()
    finally:
        os.chmod(videos, stat.S_IRWXU)
    assert listing(videos) == before
    assert train.parent == tmp_path / "work" / "data"
    files = {n: json.loads((d / "index.json").read_text()) for n, d in
             (("train", train), ("val", val), ("test", test))}  # fmt: skip
    assert [len(files[n]["videos"]) for n in ("train", "val", "test")] == [4, 1, 1]
    names = {n: {v.rsplit("/", 1)[1] for v in f["videos"]} for n, f in files.items()}
    assert not names["train"] & (names["val"] | names["test"]) and not names["val"] & names["test"]
    # Windows of K=2 context + F=2 future frames from each episode, whatever its length.
    span = 4
    for split, windows in (("train", data.train), ("val", data.val), ("test", data.test)):
        assert len(windows) == sum(t - span + 1 for t in files[split]["lengths"]), split
        assert windows.context.shape[1:] == (2, 48, 64, 3)
        assert windows.future.shape[1:] == (2, 48, 64, 3) and windows.actions.shape[1:] == (3, 3)
        assert windows.env is None
    assert sorted(sum((f["lengths"] for f in files.values()), [])) == [8] * 5 + [11]
    assert policy.action_dim == 3  # the sidecars' columns, not an environment's


def test_non_square_frames_become_non_square_latents_and_back():
    torch.manual_seed(0)
    ae = LatentAutoencoder(build_ae_model(AEConfig(block_out_channels=[8, 8, 8]), (48, 64)))
    assert ae.frame_shape == (48, 64) and ae.latent_shape == (4, 12, 16)
    from mmrl.worldmodel.windows import FrameWindows

    rng = np.random.default_rng(0)
    frames, actions = square_episode(rng, t=5)
    windows = FrameWindows(
        context=frames[None, :2], actions=actions[None, :3], future=frames[None, 2:4],
        env=None, sources=["ep"],
    )  # fmt: skip
    processor = LatentWorldModelProcessor(ae, context=2, future=2)
    batch = processor.encode_dataset(windows, "val")
    assert batch["context_latents"].shape == (1, 2, 4, 12, 16)
    batch["response_latents"] = torch.zeros(1, 2, 4, 12, 16)
    assert processor.decode(batch)["pred_frames"].shape == (1, 2, 48, 64, 3)
    with pytest.raises(ValueError, match="takes 48x64 frames, found 32x32"):
        ae.encode(np.zeros((1, 32, 32, 3), np.uint8))
    with pytest.raises(ValueError, match=r"frames are 50x64.*task.data.resize=\[48,64\]"):
        build_ae_model(AEConfig(block_out_channels=[8, 8, 8]), (50, 64))


def test_bad_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder of videos"):
        latent_task(tmp_path, tmp_path / "missing")[0].data_dirs()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no videos"):
        latent_task(tmp_path, tmp_path / "empty")[0].data_dirs()
    videos = write_episodes(tmp_path / "videos", 4)
    np.save(videos / "ep02.npy", np.zeros((5, 3), np.float32))
    with pytest.raises(ValueError, match=r"ep02\.npy: 5 actions for the 8 frames of .*ep02\.mp4"):
        latent_task(tmp_path, videos)[0].data_dirs()
    assert not (tmp_path / "work" / "data" / "train").exists()  # checked before writing
    with pytest.raises(ValueError, match=r"task.data.videos=DIR"):
        get_task("worldmodel_latent_videos")(load_config(["task=worldmodel_latent_videos"]).task)
    # The environment recipe's state-match metric cannot read recordings.
    task, cfg = latent_task(tmp_path, videos, name="worldmodel_latent")
    ae = LatentAutoencoder(build_ae_model(AEConfig(block_out_channels=[8, 8, 8]), (48, 64)))
    ae.save_pretrained(tmp_path / "policy" / "autoencoder")
    with pytest.raises(ValueError, match=r"\['state_match'\].*worldmodel_latent_videos"):
        task.build_prompt_processor(tmp_path / "policy", cfg)
    with pytest.raises(ValueError, match="task.work_dir=.*holds videos"):
        latent_task(tmp_path, videos, work=videos)[0].data_dirs()


@pytest.mark.slow
def test_latent_videos_pretrain_grpo_and_test_split_eval(tmp_path):
    """Autoencoder at 48x64, MLE pretraining, 3 GRPO steps and the test-split comparison on
    12 tiny recorded episodes, with the recordings' folder read-only throughout."""
    from mmrl.trainer.fit import fit
    from tests.conftest import run_overrides

    videos = write_episodes(tmp_path / "videos", 12, t=10)
    before = listing(videos)
    cfg = load_config(
        run_overrides(
            tmp_path / "run",
            "task=worldmodel_latent_videos",
            f"task.data.videos={videos}",
            f"task.work_dir={tmp_path / 'work'}",
            "task.autoencoder.block_out_channels=[8,16,16]",
            "task.autoencoder.norm_num_groups=4",
            "task.autoencoder_train.steps=30",
            "task.autoencoder_train.batch_size=16",
            "task.pretrain.steps=30",
            "task.pretrain.val_every=30",
            "task.policy.hidden=32",
            "task.val_windows=8",
            "task.eval.windows=12",
            "task.eval.samples=2",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "trainer.total_steps=3",
            "trainer.test_freq=3",
        )
    )
    os.chmod(videos, stat.S_IRUSR | stat.S_IXUSR)
    try:
        result = fit(cfg)
    finally:
        os.chmod(videos, stat.S_IRWXU)
    assert listing(videos) == before
    assert np.isfinite(result.history[-1]["val/lpips/mean"])
    assert "val/state_match/mean" not in result.history[-1]  # pixel metrics only
    ae_cfg = json.loads((tmp_path / "run" / "actor" / "autoencoder" / "config.json").read_text())
    assert ae_cfg["sample_size"] == [48, 64]
    table = json.loads((tmp_path / "run" / "worldmodel_eval.json").read_text())
    assert set(table) == {"base", "rl", "reference"}
    for model in ("base", "rl"):
        for decoding in ("greedy", "sampled"):
            m = table[model][decoding]
            assert all(np.isfinite(m[k]) for k in ("psnr", "lpips", "psnr@t2", "lpips@t2")), m
    ceiling = table["reference"]["autoencoder ceiling (true future through the AE)"]
    assert np.isfinite(ceiling["psnr"]) and np.isfinite(ceiling["lpips"])
