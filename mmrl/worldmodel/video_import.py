"""Recorded videos -> train/val/test trajectory datasets under a run's output folder.

The videos' folders are only read. Episodes (one video each) are split by file, so no
held-out window comes from a video that training saw: ``val_videos``/``test_videos``
folders when given, otherwise a seeded draw of ``val_fraction``/``test_fraction`` of
the files. Every file is checked before anything is written. The written datasets carry
a key that hashes the split's file list with sizes and mtimes and the conversion
options, so a changed folder is converted again instead of being served stale data.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from mmrl.worldmodel.data import FORMAT, FORMAT_VERSION, INDEX_FILE, write_trajectories
from mmrl.worldmodel.video import VideoDataset, VideoOptions, holds_videos, list_videos

SPLITS = ("train", "val", "test")


@dataclass
class VideoSplit:
    """Where the episodes come from: one folder split by fractions, or one folder per split."""

    videos: str
    val_videos: str | None = None
    test_videos: str | None = None
    val_fraction: float = 0.15
    test_fraction: float = 0.15
    seed: int = 0


@dataclass
class VideoSource:
    """The ``data.*`` keys that read recorded videos, shared by every world-model task.

    The token route nests them under ``task.pretrain.data``, the latent route under
    ``task.data``; they mean the same everywhere (see docs/worldmodel.md, "Your own videos").
    """

    videos: str | None = None  # folder of videos + action sidecars; None: no recordings
    val_videos: str | None = None  # held-out folder; None: val_fraction of the episodes
    test_videos: str | None = None  # test folder; None: test_fraction of the episodes
    val_fraction: float = 0.15  # split by episode (whole files), drawn with the data seed
    test_fraction: float = 0.15
    sidecar: str | None = None  # actions file pattern, e.g. "{stem}.actions.csv"
    num_actions: int | None = None  # discrete action ids in [0, N); None: continuous
    fps: float | None = None  # keep every (video fps / fps)-th frame
    frame_skip: int = 1  # keep every n-th frame (when fps is None)
    crop: list[int] | None = None  # [top, left, height, width] before resizing
    resize: list[int] | None = None  # [height, width]; needed for mixed resolutions

    def video_split(self, seed: int) -> VideoSplit:
        return VideoSplit(
            str(self.videos), self.val_videos, self.test_videos, self.val_fraction,
            self.test_fraction, seed,
        )  # fmt: skip

    def video_options(self) -> VideoOptions:
        return VideoOptions(
            self.sidecar, self.num_actions, self.fps, self.frame_skip, self.crop, self.resize
        )

    def folders(self) -> tuple[str | None, str | None, str | None]:
        return self.videos, self.val_videos, self.test_videos


def refuse_state_verifiers(verifiers: list, fix: str) -> None:
    """Recorded video has no renderer to read states from: raise on ``state_match`` verifiers
    (``reward.verifiers`` entries with ``name`` and ``alias``); ``fix`` says what to use."""
    names = [v.alias or v.name for v in verifiers if v.name == "state_match"]
    if names:
        raise ValueError(
            f"reward.verifiers has {names}, which reads states from a known environment's "
            f"frames; recorded videos have none: {fix}"
        )


def split_videos(split: VideoSplit) -> dict[str, list[Path]]:
    """The video files of each split, in sorted order within a split."""
    files = list_videos(split.videos)
    out: dict[str, list[Path]] = {}
    for name, folder in (("val", split.val_videos), ("test", split.test_videos)):
        if folder:
            out[name] = list_videos(folder)
    draw = [
        (name, fraction)
        for name, fraction in (("val", split.val_fraction), ("test", split.test_fraction))
        if name not in out
    ]
    order = np.random.default_rng(split.seed).permutation(len(files))
    taken = 0
    for name, fraction in draw:
        if not 0 < fraction < 1:
            raise ValueError(
                f"data.{name}_fraction must be in (0, 1), found {fraction}; or give "
                f"data.{name}_videos=DIR"
            )
        n = max(1, round(fraction * len(files)))
        out[name] = sorted(files[i] for i in order[taken : taken + n])
        taken += n
    out["train"] = sorted(files[i] for i in order[taken:])
    if not out["train"]:
        raise ValueError(
            f"{split.videos}: {len(files)} video(s) leave none for training after the held-out "
            "splits; add videos or give data.val_videos/data.test_videos folders"
        )
    seen: dict[Path, str] = {}
    for name in SPLITS:
        for path in out[name]:
            if path.resolve() in seen:
                raise ValueError(f"{path} is in both the {seen[path.resolve()]} and {name} splits")
            seen[path.resolve()] = name
    return out


def files_key(paths: list[Path], options: VideoOptions) -> str:
    """sha256 of the files (name, size, mtime) and the conversion options."""
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in paths]
    blob = json.dumps({"files": stats, "options": asdict(options), "v": FORMAT_VERSION})
    return hashlib.sha256(blob.encode()).hexdigest()


def check_not_video_folder(
    folder: str | Path, key: str, video_dirs: tuple[str | Path | None, ...] = ()
) -> None:
    """Refuse to write generated data into a folder that holds videos, or inside a videos
    folder."""
    folder = Path(folder).resolve()
    inside = [Path(v).resolve() for v in video_dirs if v]
    for parent in (folder, *[v for v in inside if v == folder or v in folder.parents]):
        if holds_videos(parent):
            raise ValueError(
                f"{key}={folder}: {parent} holds videos, and a folder of recordings is never "
                "written to; pass it as data.videos and point data.dir/output_dir elsewhere"
            )


def import_videos(
    split: VideoSplit, options: VideoOptions, out_root: str | Path, progress: bool = True
) -> dict[str, Path]:
    """Convert each split into a trajectory dataset ``out_root/<split>``; reuse a current one.

    All splits share one action spec (continuous ranges over every file, as the action
    space is a property of the recordings) and must agree on resolution and frame rate.
    """
    out_root = Path(out_root)
    dirs = (split.videos, split.val_videos, split.test_videos)
    check_not_video_folder(out_root, "data.dir", dirs)
    files = split_videos(split)
    everything = VideoDataset([p for name in SPLITS for p in files[name]], options=options)
    spans = np.cumsum([0] + [len(files[name]) for name in SPLITS])
    out = {}
    for s, name in enumerate(SPLITS):
        dest = out_root / name
        key = files_key(files[name], options)
        if _current(dest, key):
            out[name] = dest
            continue
        if dest.exists():
            _remove_stale(dest)
        out[name] = _write(everything, range(int(spans[s]), int(spans[s + 1])), dest, key, progress)
    return out


def _remove_stale(dest: Path) -> None:
    """Delete an earlier conversion whose videos have changed; refuse anything else."""
    index = dest / INDEX_FILE
    if not (index.exists() and "source_key" in json.loads(index.read_text())):
        raise ValueError(
            f"{dest} exists and is not a dataset imported from videos; choose another data.dir"
        )
    shutil.rmtree(dest)


def _current(dest: Path, key: str) -> bool:
    index = dest / INDEX_FILE
    return index.exists() and json.loads(index.read_text()).get("source_key") == key


def _write(source: VideoDataset, items: range, dest: Path, key: str, progress: bool) -> Path:
    info = source.info
    lengths = [source.num_frames(i) for i in items]
    index = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "env": None,
        "env_config": {},
        "fps": info.fps,
        "height": info.height,
        "width": info.width,
        "action": info.action.to_json(),
        "length": max(lengths),
        "lengths": lengths,
        "n_trajectories": len(lengths),
        "seed": None,
        "seeds": list(range(len(lengths))),
        "videos": [str(source.paths[i].resolve()) for i in items],
        "source_key": key,
    }
    staging = dest.with_name(dest.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    bar = tqdm(items, desc=f"import {dest.name} videos", disable=not progress)

    def chunks():
        for j, i in enumerate(bar):
            traj = source.trajectory(i)
            yield traj.frames[None], traj.actions[None], np.array([j])

    try:
        write_trajectories(staging, index, chunks())
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.rename(dest)
    return dest
