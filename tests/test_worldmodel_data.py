"""Trajectory datasets on disk, windows, and mp4 + sidecar actions readers."""

import json

import numpy as np
import pytest
from safetensors import safe_open

from mmrl.worldmodel.data import (
    INDEX_FILE,
    TrajectoryDataset,
    WindowDataset,
    generate_dataset,
    rollout,
)
from mmrl.worldmodel.envs import make_env
from mmrl.worldmodel.video import VideoDataset, read_actions, write_mp4


@pytest.mark.parametrize("name", ["grid", "push"])
def test_generate_and_read_round_trip(tmp_path, name):
    out = generate_dataset(
        name, n_trajectories=5, length=6, out_dir=tmp_path, seed=3, chunk_size=2, progress=False
    )
    index = json.loads((out / INDEX_FILE).read_text())
    env = make_env(name)
    assert [c["count"] for c in index["chunks"]] == [2, 2, 1]
    assert (index["height"], index["width"], index["fps"]) == (env.height, env.width, env.fps)
    assert index["action"]["dim"] == env.action_spec.dim and len(index["seeds"]) == 5
    with safe_open(str(out / index["chunks"][0]["file"]), "pt") as f:
        assert list(f.get_tensor("frames").shape) == [2, 6, env.height, env.width, 3]
        assert list(f.get_tensor("actions").shape) == [2, 5, env.action_spec.dim]
    data = TrajectoryDataset(out)
    assert len(data) == 5 and data.info.env == name
    for i in (0, 3, 4):
        traj = data.trajectory(i)
        frames, actions = rollout(env, index["seeds"][i], 6)  # each trajectory regenerates alone
        assert np.array_equal(traj.frames, frames) and np.array_equal(traj.actions, actions)
        assert traj.frames.dtype == np.uint8 and traj.actions.dtype == np.float32
    assert data.all_frames().shape == (5, 6, env.height, env.width, 3)


def test_existing_dataset_is_reused_or_refused(tmp_path):
    generate_dataset("grid", 3, 4, tmp_path, seed=0, progress=False)
    stamp = (tmp_path / INDEX_FILE).stat().st_mtime_ns
    generate_dataset("grid", 3, 4, tmp_path, seed=0, progress=False)
    assert (tmp_path / INDEX_FILE).stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="seed: 0 on disk vs 1 asked"):
        generate_dataset("grid", 3, 4, tmp_path, seed=1, progress=False)


def test_windows_align_frames_and_actions(tmp_path):
    data = TrajectoryDataset(generate_dataset("push", 2, 8, tmp_path, seed=0, progress=False))
    windows = WindowDataset(data, context=2, future=3, stride=2)
    assert len(windows) == 2 * 2  # starts 0 and 2 in each 8-frame trajectory
    w = windows[3]
    traj = data.trajectory(1)
    assert w.start == 2 and w.context.shape == (2, 32, 32, 3) and w.future.shape == (3, 32, 32, 3)
    assert np.array_equal(w.context, traj.frames[2:4]) and np.array_equal(
        w.future, traj.frames[4:7]
    )
    assert np.array_equal(w.actions, traj.actions[2:6])  # K + F - 1 = 4 actions
    with pytest.raises(ValueError, match="9 frames"):
        WindowDataset(data, context=4, future=5)


def moving_square(n_frames: int, size: int = 64) -> np.ndarray:
    frames = np.zeros((n_frames, size, size, 3), dtype=np.uint8)
    for t in range(n_frames):
        frames[t, 16:32, 4 * t : 4 * t + 16] = (255, 128, 0)
    return frames


def test_mp4_with_npy_and_csv_actions(tmp_path):
    frames = moving_square(10)
    write_mp4(tmp_path / "a.mp4", frames, fps=5)
    write_mp4(tmp_path / "b.mp4", frames[:8], fps=5)
    np.save(tmp_path / "a.npy", np.arange(9 * 2, dtype=np.float32).reshape(9, 2))
    (tmp_path / "b.csv").write_text("dx,dy\n" + "".join(f"{t},{-t}\n" for t in range(8)))
    data = VideoDataset(tmp_path)
    assert len(data) == 2 and data.info.fps == pytest.approx(5.0)
    assert (data.info.height, data.info.width, data.info.action.dim) == (64, 64, 2)
    a, b = data.trajectory(0), data.trajectory(1)
    assert a.frames.shape == (10, 64, 64, 3) and a.actions.shape == (9, 2)
    # written losslessly by PyAV and read back by decord: only YUV rounding differs
    assert np.abs(a.frames.astype(int) - frames).max() <= 2
    assert b.actions.shape == (7, 2) and b.actions[-1].tolist() == [
        6.0,
        -6.0,
    ]  # per-frame log: last dropped
    w = WindowDataset(data, context=2, future=1)[0]
    assert w.actions.shape == (2, 2) and w.future.shape == (1, 64, 64, 3)


def test_mp4_action_count_mismatch_names_file_and_counts(tmp_path):
    write_mp4(tmp_path / "clip.mp4", moving_square(10), fps=5)
    np.save(tmp_path / "clip.npy", np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match=r"clip\.npy: 4 actions for the 10 frames of .*clip\.mp4"):
        VideoDataset(tmp_path)


def test_mp4_missing_sidecar_and_mixed_resolution(tmp_path):
    write_mp4(tmp_path / "a.mp4", moving_square(6), fps=5)
    with pytest.raises(FileNotFoundError, match=r"a\.npy or .*a\.csv"):
        VideoDataset(tmp_path)
    np.save(tmp_path / "a.npy", np.zeros(5, np.float32))
    write_mp4(tmp_path / "b.mp4", moving_square(6, size=32), fps=5)
    np.save(tmp_path / "b.npy", np.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"b\.mp4: resolution .*data\.resize"):
        VideoDataset(tmp_path)


def test_bad_csv_and_discrete_range(tmp_path):
    (tmp_path / "x.csv").write_text("a\n1\nfoo\n")
    with pytest.raises(ValueError, match=r"x\.csv: every row after the header must be numbers"):
        read_actions(tmp_path / "x.csv")
    write_mp4(tmp_path / "c.mp4", moving_square(4), fps=5)
    np.save(tmp_path / "c.npy", np.array([0, 1, 7], np.float32))
    with pytest.raises(ValueError, match=r"c\.npy: discrete actions must be integers in \[0, 3\)"):
        VideoDataset(tmp_path, num_actions=3)


def test_write_mp4_lossy_and_bad_frames(tmp_path):
    import decord

    frames = moving_square(6)
    write_mp4(tmp_path / "lossy.mp4", frames, fps=5, crf=23)
    back = decord.VideoReader(str(tmp_path / "lossy.mp4")).get_batch(list(range(6))).asnumpy()
    assert back.shape == frames.shape and np.abs(back.astype(int) - frames).mean() < 8
    with pytest.raises(ValueError, match="uint8 \\[T, H, W, 3\\]"):
        write_mp4(tmp_path / "x.mp4", frames.astype(np.float32), fps=5)
    assert not (tmp_path / "x.mp4").exists()
