"""Recorded videos in: folder checks, sidecars, splits by episode, caching, bad input."""

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from mmrl.worldmodel.data import TrajectoryDataset
from mmrl.worldmodel.pretrain import load_pretrain_config
from mmrl.worldmodel.pretrain_data import prepare_data
from mmrl.worldmodel.tokenizer import VQConfig, VQTokenizer, build_vq_model
from mmrl.worldmodel.video import VideoDataset, VideoOptions, write_mp4
from tests.video_data import square_episode, write_episodes


def listing(folder):
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir())


def pretrain_cfg(tmp_path, videos, *extra):
    return load_pretrain_config(
        [f"data.videos={videos}", f"output_dir={tmp_path / 'run'}", "progress_bar=false", *extra]
    )


def test_import_splits_by_episode_and_never_writes_the_video_folder(tmp_path):
    videos = write_episodes(tmp_path / "videos", 10)
    before = listing(videos)
    os.chmod(videos, stat.S_IRUSR | stat.S_IXUSR)  # a-w: any write there would fail
    try:
        cfg = pretrain_cfg(tmp_path, videos)
        train, val, test = prepare_data(cfg)
    finally:
        os.chmod(videos, stat.S_IRWXU)
    assert listing(videos) == before
    assert train.parent == tmp_path / "run" / "data"
    files = {n: json.loads((d / "index.json").read_text())["videos"] for n, d in
             (("train", train), ("val", val), ("test", test))}  # fmt: skip
    assert [len(files[n]) for n in ("train", "val", "test")] == [6, 2, 2]
    assert not set(files["train"]) & (set(files["val"]) | set(files["test"]))
    data = TrajectoryDataset(train)
    assert data.info.env is None and (data.info.height, data.info.width) == (48, 64)
    assert data.info.action.kind == "continuous" and data.info.action.dim == 3
    traj = data.trajectory(0)
    assert traj.frames.shape == (8, 48, 64, 3) and traj.actions.shape == (7, 3)
    # the cache is reused while the files are unchanged, and rebuilt when one changes
    stamp = (train / "index.json").stat().st_mtime_ns
    assert prepare_data(cfg)[0] == train and (train / "index.json").stat().st_mtime_ns == stamp
    changed = sorted(videos.glob("*.mp4"))[int(files["train"][0][-6:-4])]
    np.save(changed.with_suffix(".npy"), np.zeros((7, 3), np.float32))
    os.utime(changed.with_suffix(".npy"))
    write_mp4(changed, np.zeros((8, 48, 64, 3), np.uint8), fps=10)
    prepare_data(cfg)
    assert (train / "index.json").stat().st_mtime_ns != stamp


def test_separate_val_and_test_folders_and_sidecar_patterns(tmp_path):
    train = write_episodes(tmp_path / "a", 3, sidecar="{stem}.actions.npy")
    val = write_episodes(tmp_path / "b", 1, seed=1, sidecar="{stem}.actions.npy")
    test = write_episodes(tmp_path / "c", 1, seed=2, sidecar="{stem}.actions.npy")
    cfg = pretrain_cfg(tmp_path, train, f"data.val_videos={val}", f"data.test_videos={test}")
    dirs = prepare_data(cfg)
    assert [len(TrajectoryDataset(d)) for d in dirs] == [3, 1, 1]
    labels = write_episodes(tmp_path / "d", 2, sidecar="{stem}_log.npy")
    with pytest.raises(FileNotFoundError, match=r"ep00\.mp4: no actions file; expected .*"):
        VideoDataset(labels)
    data = VideoDataset(labels, options=VideoOptions(sidecar="{stem}_log.npy"))
    assert len(data) == 2


def test_frame_skip_crop_and_resize(tmp_path):
    videos = write_episodes(tmp_path / "v", 1, t=9)
    raw = VideoDataset(videos)
    opts = VideoOptions(frame_skip=2, crop=[0, 0, 48, 48], resize=[32, 32])
    thin = VideoDataset(videos, options=opts)
    a, b = raw.trajectory(0), thin.trajectory(0)
    assert b.frames.shape == (5, 32, 32, 3) and b.actions.shape == (4, 3)
    assert np.allclose(b.actions[1], a.actions[2:4].mean(0))  # continuous: mean of the skipped
    assert thin.info.fps == pytest.approx(5.0)
    assert VideoDataset(videos, options=VideoOptions(fps=5)).num_frames(0) == 5


def test_tokenizer_grid_follows_the_videos_resolution():
    cfg = VQConfig()
    assert VQTokenizer(build_vq_model(cfg, (48, 64))).grid == (6, 8)  # 8x: 48 tokens
    assert VQTokenizer(build_vq_model(cfg, (32, 32))).grid == (8, 8)  # 4x: 64 tokens
    tok = VQTokenizer(build_vq_model(cfg, (48, 64)))
    frames = np.zeros((2, 48, 64, 3), np.uint8)
    assert tok.encode(frames).shape == (2, 6, 8) and tok.decode(tok.encode(frames)).shape == (
        2, 48, 64, 3,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"50x64 frames .*data\.resize"):
        build_vq_model(cfg, (50, 64))


def nothing_written(tmp_path, cfg, match, exc=ValueError):
    with pytest.raises(exc, match=match):
        prepare_data(cfg)
    assert not (tmp_path / "run").exists()


def test_bad_input_names_the_file_and_writes_nothing(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing_written(tmp_path, pretrain_cfg(tmp_path, empty), r"empty: no videos", FileNotFoundError)

    videos = write_episodes(tmp_path / "v", 4)
    (videos / "ep01.mp4").write_bytes(b"not a video" * 50)
    cfg = pretrain_cfg(tmp_path, videos)
    nothing_written(tmp_path, cfg, r"ep01\.mp4: corrupt or truncated video")
    write_episodes(tmp_path / "v", 4)
    whole = (videos / "ep02.mp4").read_bytes()
    (videos / "ep02.mp4").write_bytes(whole[: len(whole) // 2])
    nothing_written(tmp_path, cfg, r"ep02\.mp4: corrupt or truncated video")
    write_episodes(tmp_path / "v", 4)

    np.save(videos / "ep03.npy", np.zeros((3, 3), np.float32))
    nothing_written(tmp_path, cfg, r"ep03\.npy: 3 actions for the 8 frames of .*ep03\.mp4")
    bad = np.zeros((7, 3), np.float32)
    bad[4, 1] = np.nan
    np.save(videos / "ep03.npy", bad)
    nothing_written(tmp_path, cfg, r"ep03\.npy: actions contain NaN .*row 4")
    write_episodes(tmp_path / "v", 4)

    write_mp4(videos / "ep04.mp4", square_episode(np.random.default_rng(0), 8, (32, 32))[0], 10)
    np.save(videos / "ep04.npy", np.zeros((7, 3), np.float32))
    nothing_written(tmp_path, cfg, r"ep04\.mp4: resolution .*set data\.resize")
    assert len(VideoDataset(videos, options=VideoOptions(resize=[48, 64]))) == 5
    (videos / "ep04.mp4").unlink()
    write_mp4(videos / "ep04.mp4", square_episode(np.random.default_rng(0), 8)[0], 20)
    nothing_written(tmp_path, cfg, r"ep04\.mp4: frame rate 20.0 differs .*set data\.fps")
    assert VideoDataset(videos, options=VideoOptions(fps=10)).num_frames(4) == 4

    into = pretrain_cfg(tmp_path, videos, f"data.dir={videos}")
    nothing_written(
        tmp_path, into, r"data\.dir=.*holds videos, and a folder of recordings is never"
    )


def test_env_data_dir_holding_videos_is_refused(tmp_path):
    videos = write_episodes(tmp_path / "mine", 1)
    cfg = load_pretrain_config([f"data.dir={videos}", f"output_dir={tmp_path / 'run'}"])
    before = listing(videos)
    nothing_written(tmp_path, cfg, r"holds videos.*pass it as data\.videos")
    assert listing(videos) == before


@pytest.mark.parametrize("width", [48, 64])
def test_frames_read_back_as_written(tmp_path, width):
    """decord reads most widths; the ones it mis-strides (48: dmlc/decord#336) still read."""
    frames = np.random.default_rng(0).integers(0, 256, (5, 32, width, 3)).astype(np.uint8)
    write_mp4(tmp_path / "a.mp4", frames, fps=4)
    np.save(tmp_path / "a.npy", np.zeros((4, 1), np.float32))
    back = VideoDataset(tmp_path).trajectory(0).frames
    assert back.shape == frames.shape and np.abs(back.astype(int) - frames).max() <= 2


def test_task_pretraining_cache_follows_the_videos(tmp_path):
    """A finished pretraining run is reused only while the video files are unchanged."""
    from dataclasses import asdict

    from mmrl.tasks.worldmodel_tokens import cached_pretraining, pretrain_config
    from mmrl.worldmodel.pretrain_data import video_keys

    videos = write_episodes(tmp_path / "videos", 4)
    cfg = pretrain_config({"data": {"videos": str(videos)}}, str(tmp_path / "cache"))
    assert Path(cfg.output_dir).name.startswith("videos-")
    Path(cfg.output_dir).mkdir(parents=True)
    summary = {"config": asdict(cfg), "video_keys": video_keys(cfg)}
    (Path(cfg.output_dir) / "pretrain_summary.json").write_text(json.dumps(summary))
    assert cached_pretraining(cfg) is not None
    clip = videos / "ep01.mp4"
    os.utime(clip, ns=(clip.stat().st_atime_ns, clip.stat().st_mtime_ns + 10**9))
    assert cached_pretraining(cfg) is None


def test_state_match_rewards_are_refused_for_recorded_video(tmp_path):
    from mmrl.config import load_config
    from mmrl.tasks import get_task

    cfg = load_config(["task=worldmodel_tokens", f"++task.pretrain.data.videos={tmp_path}"])
    with pytest.raises(ValueError, match=r"\['state_match'\].*use task=worldmodel_videos"):
        get_task("worldmodel_tokens")(cfg.task).build_prompt_processor(tmp_path, cfg)
    with pytest.raises(ValueError, match="task.pretrain.data.videos=DIR"):
        get_task("worldmodel_videos")(load_config(["task=worldmodel_videos"]).task)


def test_eval_refuses_actions_outside_the_trained_range(tmp_path):
    import torch

    from mmrl.tasks.worldmodel_eval import TOKENIZER_SUBDIR
    from mmrl.trainer.eval_worldmodel import main
    from mmrl.worldmodel.envs import ActionSpec
    from mmrl.worldmodel.token_lm import (
        TokenLMConfig,
        TokenWorldModelProcessor,
        build_token_world_model,
        save_token_world_model,
    )
    from mmrl.worldmodel.vocab import VocabLayout

    torch.manual_seed(0)
    tok = VQTokenizer(
        build_vq_model(VQConfig(codebook_size=16, block_out_channels=[8] * 4), (48, 64))
    )
    action = ActionSpec("continuous", 3, low=-1.0, high=1.0)
    proc = TokenWorldModelProcessor(VocabLayout(16, tok.grid, action), context=2, future=1)
    model = build_token_world_model(proc, TokenLMConfig(64, 64, 1, 1, 1, 256))
    save_token_world_model(model, proc, tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt" / TOKENIZER_SUBDIR)
    videos = write_episodes(tmp_path / "videos", 1)
    args = ["--model", str(tmp_path / "ckpt"), "--data", str(videos), "--windows", "2"]
    assert main([*args, "--samples", "1"]) == 0  # actions in [-1, 1]: fine
    np.save(videos / "ep00.npy", np.full((7, 3), 1.5, np.float32))
    with pytest.raises(ValueError, match=r"actions span \[1.5, 1.5\], outside the range \[-1, 1\]"):
        main(args)
