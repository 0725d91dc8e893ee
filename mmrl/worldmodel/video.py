"""Real videos as trajectories: mp4 files read with decord, each with a sidecar actions file.

For ``clip.mp4`` the actions are in ``clip.npy`` (``float [N, A]``, or ``[N]`` for one
column) or ``clip.csv`` (one row per action, comma-separated numbers; a first
line that is not numeric is taken as a header). With ``T`` frames, ``N`` must be
``T-1`` (``actions[t]`` leads from frame ``t`` to ``t+1``) or ``T`` (one action
logged with every frame; the last one leads nowhere and is dropped). Frame rate,
resolution and action dimension come from the files and must agree across them.
"""

from __future__ import annotations

import csv
from fractions import Fraction
from pathlib import Path

import numpy as np

from mmrl.worldmodel.data import SourceInfo, Trajectory
from mmrl.worldmodel.envs import ActionSpec

SIDECAR_SUFFIXES = (".npy", ".csv")


def read_actions(path: str | Path) -> np.ndarray:
    """A sidecar actions file as ``float32 [N, A]``."""
    path = Path(path)
    if path.suffix == ".npy":
        actions = np.load(path, allow_pickle=False)
    elif path.suffix == ".csv":
        with path.open(newline="") as f:
            rows = [r for r in csv.reader(f) if r and any(c.strip() for c in r)]
        if rows and not _numeric(rows[0]):
            rows = rows[1:]
        try:
            actions = np.array([[float(c) for c in r] for r in rows], dtype=np.float32)
        except ValueError as err:
            raise ValueError(
                f"{path}: every row after the header must be numbers ({err})"
            ) from None
    else:
        raise ValueError(f"{path}: actions must be .npy or .csv, found {path.suffix!r}")
    actions = np.asarray(actions, dtype=np.float32)
    if actions.ndim == 1:
        actions = actions[:, None]
    if actions.ndim != 2:
        raise ValueError(
            f"{path}: actions must be [N, A] or [N], found shape {list(actions.shape)}"
        )
    if not np.isfinite(actions).all():
        raise ValueError(f"{path}: actions contain NaN or inf")
    return actions


def _numeric(row: list[str]) -> bool:
    try:
        [float(c) for c in row]
    except ValueError:
        return False
    return True


def sidecar_path(video: Path) -> Path:
    """The actions file next to ``video``: same stem, ``.npy`` preferred over ``.csv``."""
    for suffix in SIDECAR_SUFFIXES:
        candidate = video.with_suffix(suffix)
        if candidate.exists():
            return candidate
    expected = " or ".join(str(video.with_suffix(s)) for s in SIDECAR_SUFFIXES)
    raise FileNotFoundError(f"{video}: no actions file; expected {expected}")


def align_actions(
    actions: np.ndarray, n_frames: int, actions_path: Path, video: Path
) -> np.ndarray:
    """Check the counts and return the ``[T-1, A]`` transition actions."""
    n = len(actions)
    if n == n_frames - 1:
        return actions
    if n == n_frames:
        return actions[:-1]
    raise ValueError(
        f"{actions_path}: {n} actions for the {n_frames} frames of {video}; expected "
        f"{n_frames - 1} (one per transition) or {n_frames} (one per frame, the last dropped)"
    )


class VideoDataset:
    """mp4 files (a folder or a list) with sidecar actions, as a trajectory source.

    ``num_actions`` marks the actions as discrete ids in ``[0, num_actions)``;
    otherwise they are continuous with bounds taken from the data.
    """

    def __init__(self, videos: str | Path | list[str | Path], num_actions: int | None = None):
        import decord

        paths = (
            sorted(Path(videos).glob("*.mp4"))
            if isinstance(videos, str | Path)
            else [Path(v) for v in videos]
        )
        if not paths:
            raise FileNotFoundError(f"no .mp4 files in {videos}")
        self.paths = paths
        self._cache: Trajectory | None = None
        self._lengths, self._actions, fps, shapes = [], [], [], []
        for video in paths:
            reader = decord.VideoReader(str(video))
            n_frames = len(reader)
            shapes.append(tuple(reader[0].shape))
            fps.append(float(reader.get_avg_fps()))
            actions_path = sidecar_path(video)
            self._actions.append(
                align_actions(read_actions(actions_path), n_frames, actions_path, video)
            )
            self._lengths.append(n_frames)
        _same("resolution [H, W, 3]", shapes, paths)
        _same("action dimension", [a.shape[1] for a in self._actions], paths)
        _same("frame rate", [round(f, 3) for f in fps], paths)
        self.info = SourceInfo(
            fps=fps[0], height=shapes[0][0], width=shapes[0][1], action=self._spec(num_actions)
        )
        for video, actions in zip(paths, self._actions, strict=True):
            self.info.action.check(actions, str(sidecar_path(video)))

    def _spec(self, num_actions: int | None) -> ActionSpec:
        dim = self._actions[0].shape[1]
        if num_actions is not None:
            return ActionSpec(kind="discrete", dim=dim, num_actions=num_actions)
        stacked = np.concatenate(self._actions)
        low, high = float(stacked.min()), float(stacked.max())
        return ActionSpec(kind="continuous", dim=dim, low=low, high=max(high, low + 1e-6))

    def __len__(self) -> int:
        return len(self.paths)

    def num_frames(self, i: int) -> int:
        return self._lengths[i]

    def trajectory(self, i: int) -> Trajectory:
        """Decode video ``i`` (the last one decoded is kept)."""
        import decord

        if self._cache is None or self._cache.source != str(self.paths[i]):
            reader = decord.VideoReader(str(self.paths[i]))
            frames = reader.get_batch(list(range(len(reader)))).asnumpy().astype(np.uint8)
            self._cache = Trajectory(frames, self._actions[i], str(self.paths[i]))
        return self._cache


def _same(what: str, values: list, paths: list[Path]) -> None:
    for value, path in zip(values, paths, strict=True):
        if value != values[0]:
            raise ValueError(
                f"{what} differs between videos: {values[0]} in {paths[0]}, {value} in {path}"
            )


def write_mp4(path: str | Path, frames: np.ndarray, fps: float, crf: int = 0) -> Path:
    """Write ``frames uint8 [T, H, W, 3]`` as an H.264 mp4 with PyAV.

    ``crf=0`` with full-resolution chroma (yuv444p) is lossless up to the RGB <-> YUV
    rounding (about 0.4 grey levels), so data written here reads back as what was written;
    a higher ``crf`` (e.g. 23) gives the lossy 4:2:0 files cameras and phones make.
    """
    import av

    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or not len(frames):
        raise ValueError(
            f"write_mp4 takes frames uint8 [T, H, W, 3] with T >= 1, found {frames.dtype} "
            f"{list(frames.shape)}"
        )
    lossless = crf == 0
    if not lossless and (frames.shape[1] % 2 or frames.shape[2] % 2):
        raise ValueError(f"lossy 4:2:0 video needs even height and width, found {frames.shape}")
    path = Path(path)
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv444p" if lossless else "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames
    return path
