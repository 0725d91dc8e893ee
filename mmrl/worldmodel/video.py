"""Recorded videos as trajectories: files decord reads (mp4, ...), each with an actions sidecar.

For ``clip.mp4`` the actions are in the first of ``clip.npy``, ``clip.csv``,
``clip.actions.npy`` and ``clip.actions.csv`` that exists, or in the file a
``sidecar`` pattern names (``{stem}`` is the video's name without its suffix, e.g.
``labels/{stem}.csv``). ``.npy`` holds ``float [N, A]`` (or ``[N]`` for one column);
``.csv`` one row per action, comma-separated numbers, a non-numeric first line being a
header. With ``T`` frames, ``N`` must be ``T-1`` (``actions[t]`` leads from frame ``t``
to ``t+1``) or ``T`` (one action logged with every frame; the last one leads nowhere
and is dropped).

:class:`VideoOptions` crops, resizes and thins the frames (``frame_skip``, or a target
``fps``). Resolution, frame rate and action dimension must agree across the videos
unless ``resize`` (resolution) or ``fps`` (frame rate) makes them agree. Every error
names the file and the fix.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.errors import DataNotFoundError
from mmrl.worldmodel.data import SourceInfo, Trajectory
from mmrl.worldmodel.envs import ActionSpec

VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm")
SIDECAR_PATTERNS = ("{stem}.npy", "{stem}.csv", "{stem}.actions.npy", "{stem}.actions.csv")


@dataclass
class VideoOptions:
    """How recorded videos become trajectories (``data.*`` keys of the pretraining config)."""

    sidecar: str | None = None  # actions file pattern, e.g. "{stem}.actions.csv"; None: defaults
    num_actions: int | None = None  # discrete action ids in [0, num_actions); None: continuous
    fps: float | None = None  # keep every (video fps / fps)-th frame; must divide evenly
    frame_skip: int = 1  # keep every n-th frame (ignored when fps is set)
    crop: list[int] | None = None  # [top, left, height, width], applied before resize
    resize: list[int] | None = None  # [height, width] of every frame after cropping

    def __post_init__(self) -> None:
        if self.frame_skip < 1:
            raise ValueError(f"data.frame_skip must be >= 1, found {self.frame_skip}")
        if self.fps is not None and self.fps <= 0:
            raise ValueError(f"data.fps must be > 0, found {self.fps}")
        if self.crop is not None and (len(self.crop) != 4 or min(self.crop[2:]) < 1):
            raise ValueError(f"data.crop must be [top, left, height, width], found {self.crop}")
        if self.resize is not None and (len(self.resize) != 2 or min(self.resize) < 1):
            raise ValueError(f"data.resize must be [height, width], found {self.resize}")


def list_videos(folder: str | Path) -> list[Path]:
    """The video files in ``folder`` (not recursive), sorted; an error when there are none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataNotFoundError(f"{folder}: no such folder of videos")
    paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in VIDEO_SUFFIXES)
    if not paths:
        raise DataNotFoundError(
            f"{folder}: no videos ({', '.join('*' + s for s in VIDEO_SUFFIXES)}); point "
            "data.videos at the folder that holds your recordings and their action files"
        )
    return paths


def holds_videos(folder: str | Path) -> bool:
    folder = Path(folder)
    return folder.is_dir() and any(p.suffix.lower() in VIDEO_SUFFIXES for p in folder.iterdir())


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
        row = int(np.nonzero(~np.isfinite(actions).all(1))[0][0])
        raise ValueError(
            f"{path}: actions contain NaN or inf (first in row {row}); fill or drop those rows"
        )
    return actions


def _numeric(row: list[str]) -> bool:
    try:
        [float(c) for c in row]
    except ValueError:
        return False
    return True


def sidecar_path(video: Path, pattern: str | None = None) -> Path:
    """The actions file of ``video``: ``pattern`` (relative to the video's folder), or the first
    default name that exists."""
    patterns = (pattern,) if pattern else SIDECAR_PATTERNS
    candidates = [video.parent / p.format(stem=video.stem) for p in patterns]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    expected = " or ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"{video}: no actions file; expected {expected} (or set data.sidecar to a pattern)"
    )


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


def skip_actions(actions: np.ndarray, step: int, discrete: bool) -> np.ndarray:
    """Transition actions ``[T-1, A]`` -> those between every ``step``-th frame.

    The ``step`` actions between two kept frames become their mean (continuous) or the
    first of them (discrete ids cannot be averaged).
    """
    if step == 1:
        return actions
    n = len(actions) // step
    groups = actions[: n * step].reshape(n, step, actions.shape[1])
    return groups[:, 0] if discrete else groups.mean(1)


def _open(video: Path) -> Any:
    import decord

    try:
        reader = decord.VideoReader(str(video))
        n = len(reader)
    except (RuntimeError, decord.DECORDError) as err:
        raise ValueError(
            f"{video}: corrupt or truncated video, it cannot be opened "
            f"({str(err).splitlines()[0][:80]}); re-encode it (ffmpeg -i in out.mp4) or move it "
            "out of the folder"
        ) from None
    if n < 2:
        raise ValueError(f"{video}: {n} frame(s); a trajectory needs at least 2, remove it")
    return reader


def _decode(reader: Any, video: Path, indices: list[int]) -> np.ndarray:
    import decord

    try:
        frames = reader.get_batch(indices).asnumpy()
    except (RuntimeError, decord.DECORDError) as err:
        # decord 0.6 mis-strides some frame widths (16, 24, 48, 72, ...: dmlc/decord#336) and
        # fails with a size check; PyAV decodes those files correctly.
        frames = _decode_pyav(video, indices) if "CopyFromTo" in str(err) else None
    if frames is None or len(frames) != len(indices):
        raise ValueError(
            f"{video}: corrupt or truncated video, its header lists {len(reader)} frames but "
            "they do not all decode; re-encode it (ffmpeg -i in out.mp4) or move it out of the "
            "folder"
        )
    return frames.astype(np.uint8)


def _decode_pyav(video: Path, indices: list[int]) -> np.ndarray | None:
    import av

    try:
        with av.open(str(video)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    except av.FFmpegError:
        return None
    if max(indices) >= len(frames):
        return None
    return np.stack([frames[i] for i in indices])


class VideoDataset:
    """Videos (a folder or a list of files) with sidecar actions, as a trajectory source.

    ``num_actions`` marks the actions as discrete ids in ``[0, num_actions)``;
    otherwise they are continuous with bounds taken from the data. Opening checks every
    file (readable, sidecar rows, shapes, rates) and decodes each one's last frame, so
    a truncated file is named before anything is written.
    """

    def __init__(
        self,
        videos: str | Path | list[str | Path],
        num_actions: int | None = None,
        options: VideoOptions | None = None,
    ):
        opts = options or VideoOptions(num_actions=num_actions)
        if num_actions is not None:
            opts.num_actions = num_actions
        self.options = opts
        paths = list_videos(videos) if isinstance(videos, str | Path) else [Path(v) for v in videos]
        if not paths:
            raise FileNotFoundError("no videos given")
        self.paths = paths
        self._cache: Trajectory | None = None
        self._indices, self._actions, fps, shapes = [], [], [], []
        for video in paths:
            reader = _open(video)
            n_frames, rate = len(reader), float(reader.get_avg_fps())
            shape = tuple(_decode(reader, video, [0]).shape[1:3])  # a damaged first frame is named
            step = self._step(rate, video)
            kept = list(range(0, n_frames, step))
            _decode(reader, video, [kept[-1]])
            actions_path = sidecar_path(video, opts.sidecar)
            actions = align_actions(read_actions(actions_path), n_frames, actions_path, video)
            if opts.num_actions is not None:
                ActionSpec("discrete", 1, opts.num_actions).check(actions, str(actions_path))
            actions = skip_actions(actions, step, opts.num_actions is not None)
            self._indices.append(kept[: len(actions) + 1])
            self._actions.append(actions)
            shapes.append(self._out_shape(shape, video))
            fps.append(rate / step)
        if opts.resize is None:
            _same("resolution (height, width)", shapes, paths, "set data.resize: [H, W]")
        if opts.fps is None:
            _same("frame rate", [round(f, 3) for f in fps], paths, "set data.fps")
        _same("action dimension", [a.shape[1] for a in self._actions], paths, "fix the sidecars")
        self.info = SourceInfo(
            fps=fps[0], height=shapes[0][0], width=shapes[0][1], action=self._spec()
        )

    def _step(self, rate: float, video: Path) -> int:
        if self.options.fps is None:
            return self.options.frame_skip
        ratio = rate / self.options.fps
        step = round(ratio)
        if step < 1 or abs(ratio - step) > 0.01 * ratio:
            raise ValueError(
                f"{video}: {rate:g} fps is not a whole multiple of data.fps={self.options.fps:g}; "
                "choose a data.fps that divides every video's frame rate"
            )
        return step

    def _out_shape(self, shape: tuple[int, int], video: Path) -> tuple[int, int]:
        crop, resize = self.options.crop, self.options.resize
        if crop is not None:
            top, left, h, w = crop
            if top < 0 or left < 0 or top + h > shape[0] or left + w > shape[1]:
                raise ValueError(
                    f"{video}: data.crop={list(crop)} does not fit its {shape[0]}x{shape[1]} "
                    "frames; choose a crop inside every video"
                )
            shape = (h, w)
        return (int(resize[0]), int(resize[1])) if resize is not None else shape

    def _spec(self) -> ActionSpec:
        dim = self._actions[0].shape[1]
        if self.options.num_actions is not None:
            return ActionSpec(kind="discrete", dim=dim, num_actions=self.options.num_actions)
        stacked = np.concatenate(self._actions)
        low, high = float(stacked.min()), float(stacked.max())
        return ActionSpec(kind="continuous", dim=dim, low=low, high=max(high, low + 1e-6))

    def __len__(self) -> int:
        return len(self.paths)

    def num_frames(self, i: int) -> int:
        return len(self._indices[i])

    def trajectory(self, i: int) -> Trajectory:
        """Decode video ``i``, cropped, resized and thinned (the last one decoded is kept)."""
        path = self.paths[i]
        if self._cache is None or self._cache.source != str(path):
            frames = _decode(_open(path), path, self._indices[i])
            self._cache = Trajectory(self._transform(frames), self._actions[i], str(path))
        return self._cache

    def _transform(self, frames: np.ndarray) -> np.ndarray:
        if self.options.crop is not None:
            top, left, h, w = self.options.crop
            frames = frames[:, top : top + h, left : left + w]
        size = self.options.resize
        if size is None or tuple(frames.shape[1:3]) == tuple(size):
            return np.ascontiguousarray(frames)
        import torch

        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
        x = torch.nn.functional.interpolate(
            x, size=tuple(size), mode="bilinear", antialias=True, align_corners=False
        )
        return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def _same(what: str, values: list, paths: list[Path], fix: str) -> None:
    for value, path in zip(values, paths, strict=True):
        if value != values[0]:
            raise ValueError(
                f"{path}: {what} {value} differs from {values[0]} in {paths[0]}; {fix}"
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
