"""Trajectory datasets on disk, their generator, and (context, actions, future) windows.

On-disk format (a folder; see docs/worldmodel.md):

- ``index.json``: ``format``, ``format_version``, ``env``, ``env_config``, ``fps``,
  ``height``, ``width``, ``action`` (an :class:`ActionSpec`), ``length`` (frames per
  trajectory), ``n_trajectories``, ``seed``, ``seeds`` (one env seed per trajectory)
  and ``chunks`` (``[{"file", "count"}]`` in trajectory order). Written last, so a
  folder with an index is complete. Data imported from videos (``env`` null) also
  has ``lengths`` (frames of each trajectory, which may differ; one trajectory per
  chunk then) and ``videos`` (the source files with their sizes and mtimes).
- ``chunk_XXXXX.safetensors``: ``frames uint8 [N, T, H, W, 3]``,
  ``actions float32 [N, T-1, A]`` and ``seeds int64 [N]``. ``actions[t]`` is the
  action taken between frame ``t`` and frame ``t+1``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from mmrl.errors import DataError
from mmrl.worldmodel.envs import ActionSpec, Env, make_env

FORMAT = "mmrl-trajectories"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"


@dataclass(frozen=True)
class SourceInfo:
    """What every trajectory source states about its data."""

    fps: float
    height: int
    width: int
    action: ActionSpec
    env: str | None = None  # the procedural env that made the data, if any


@dataclass
class Trajectory:
    """``frames uint8 [T, H, W, 3]`` and ``actions float32 [T-1, A]`` from ``source``."""

    frames: np.ndarray
    actions: np.ndarray
    source: str


class TrajectorySource(Protocol):
    info: SourceInfo

    def __len__(self) -> int: ...

    def num_frames(self, i: int) -> int: ...

    def trajectory(self, i: int) -> Trajectory: ...


def generate_dataset(
    env: Env | str,
    n_trajectories: int,
    length: int,
    out_dir: str | Path,
    seed: int,
    chunk_size: int = 64,
    progress: bool = True,
) -> Path:
    """Roll out ``env``'s exploration policy and write ``n_trajectories`` of ``length`` frames.

    Trajectory ``i`` resets the env with ``seeds[i]`` (drawn from ``seed``), so any
    trajectory can be regenerated alone. An existing complete dataset with the same
    settings is reused; one with other settings is an error (delete it or pick
    another folder). Returns ``out_dir``.
    """
    env = make_env(env) if isinstance(env, str) else env
    if length < 2 or n_trajectories < 1:
        raise ValueError(
            f"need length >= 2 and n_trajectories >= 1, found {length}, {n_trajectories}"
        )
    out = Path(out_dir)
    seeds = np.random.SeedSequence(seed).generate_state(n_trajectories, dtype=np.uint32)
    index = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "env": env.name,
        "env_config": env.config(),
        "fps": env.fps,
        "height": env.height,
        "width": env.width,
        "action": env.action_spec.to_json(),
        "length": length,
        "n_trajectories": n_trajectories,
        "seed": seed,
        "seeds": [int(s) for s in seeds],
        "chunks": [],
    }
    if (out / INDEX_FILE).exists():
        return _reuse(out, index)
    bar = tqdm(total=n_trajectories, desc=f"generate {env.name} data", disable=not progress)

    def chunks() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        for start in range(0, n_trajectories, chunk_size):
            chunk_seeds = seeds[start : start + chunk_size]
            frames, actions = zip(*(rollout(env, int(s), length) for s in chunk_seeds), strict=True)
            yield np.stack(frames), np.stack(actions), chunk_seeds.astype(np.int64)
            bar.update(len(chunk_seeds))

    write_trajectories(out, index, chunks())
    bar.close()
    return out


def generate_splits(
    env: Env | str,
    sizes: dict[str, int],
    length: int,
    root: str | Path,
    seed: int,
    progress: bool = True,
) -> dict[str, Path]:
    """One generated dataset per split under ``root/<split>`` (split ``i`` draws its env seeds
    from ``seed + i``); raises if two splits share a trajectory's env seed."""
    dirs = {
        name: generate_dataset(env, n, length, Path(root) / name, seed + i, progress=progress)
        for i, (name, n) in enumerate(sizes.items())
    }
    seeds = {name: set(TrajectoryDataset(path).index["seeds"]) for name, path in dirs.items()}
    names = list(seeds)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if shared := sorted(seeds[a] & seeds[b])[:5]:
                raise ValueError(f"the {a} and {b} trajectories share env seeds: {shared}")
    return dirs


def write_trajectories(
    out: Path, index: dict[str, Any], chunks: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]]
) -> Path:
    """Write ``(frames [N, T, H, W, 3], actions [N, T-1, A], seeds [N])`` chunks, then the index.

    The index goes last, so a reader never sees a half-written dataset as complete.
    """
    out.mkdir(parents=True, exist_ok=True)
    index = {**index, "chunks": []}
    for frames, actions, seeds in chunks:
        name = f"chunk_{len(index['chunks']):05d}.safetensors"
        tensors = {
            "frames": torch.from_numpy(np.ascontiguousarray(frames)),
            "actions": torch.from_numpy(np.ascontiguousarray(actions, dtype=np.float32)),
            "seeds": torch.from_numpy(np.asarray(seeds, dtype=np.int64)),
        }
        save_file(tensors, str(out / name))
        index["chunks"].append({"file": name, "count": len(frames)})
    (out / INDEX_FILE).write_text(json.dumps(index, indent=1))
    return out


def rollout(env: Env, seed: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """One exploration trajectory: ``frames uint8 [T, H, W, 3]``, ``actions float32 [T-1, A]``."""
    policy = env.exploration_policy(np.random.default_rng([seed, 1]))
    frames, actions = [env.reset(seed)], []
    for _ in range(length - 1):
        actions.append(np.asarray(policy(), dtype=np.float32).reshape(env.action_spec.dim))
        frames.append(env.step(actions[-1]))
    return np.stack(frames), np.stack(actions)


def _reuse(out: Path, wanted: dict[str, Any]) -> Path:
    found = json.loads((out / INDEX_FILE).read_text())
    keys = ("format_version", "env", "env_config", "length", "n_trajectories", "seed", "action")
    diff = [k for k in keys if found.get(k) != wanted[k]]
    if diff:
        details = ", ".join(f"{k}: {found.get(k)!r} on disk vs {wanted[k]!r} asked" for k in diff)
        raise DataError(f"{out / INDEX_FILE} holds a different dataset ({details})")
    return out


class TrajectoryDataset:
    """Reads a folder written by :func:`generate_dataset`; chunks load on first use."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index_path = self.path / INDEX_FILE
        if not index_path.exists():
            raise DataError(f"no {INDEX_FILE} in {self.path}: not a trajectory dataset")
        self.index = json.loads(index_path.read_text())
        if self.index.get("format") != FORMAT or self.index.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"{index_path}: expected format {FORMAT!r} version {FORMAT_VERSION}, found "
                f"{self.index.get('format')!r} version {self.index.get('format_version')}"
            )
        self.info = SourceInfo(
            fps=float(self.index["fps"]),
            height=int(self.index["height"]),
            width=int(self.index["width"]),
            action=ActionSpec.from_json(self.index["action"]),
            env=self.index["env"],
        )
        counts = [c["count"] for c in self.index["chunks"]]
        self._starts = np.cumsum([0, *counts])
        self._cache: tuple[int, dict[str, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return int(self._starts[-1])

    def num_frames(self, i: int) -> int:
        lengths = self.index.get("lengths")
        return int(lengths[i] if lengths else self.index["length"])

    def frames(self) -> Iterator[np.ndarray]:
        """Each trajectory's ``frames uint8 [T, H, W, 3]`` in order (lengths may differ)."""
        for c in range(len(self._starts) - 1):
            yield from self._chunk(c)["frames"].numpy()

    def trajectory(self, i: int) -> Trajectory:
        if not 0 <= i < len(self):
            raise IndexError(f"trajectory {i} out of range for {len(self)} in {self.path}")
        c = int(np.searchsorted(self._starts, i, side="right") - 1)
        chunk = self._chunk(c)
        j = i - int(self._starts[c])
        name = self.index["chunks"][c]["file"]
        return Trajectory(
            chunk["frames"][j].numpy(), chunk["actions"][j].numpy(), f"{self.path / name}[{j}]"
        )

    def all_frames(self) -> np.ndarray:
        """Every frame, ``uint8 [N, T, H, W, 3]`` (loads the whole dataset; one length only)."""
        self._check_one_length()
        return np.concatenate(
            [self._chunk(c)["frames"].numpy() for c in range(len(self._starts) - 1)]
        )

    def all_actions(self) -> np.ndarray:
        """Every action, ``float32 [N, T-1, A]`` (one length only)."""
        self._check_one_length()
        return np.concatenate(
            [self._chunk(c)["actions"].numpy() for c in range(len(self._starts) - 1)]
        )

    def _check_one_length(self) -> None:
        lengths = set(self.index.get("lengths") or [self.index["length"]])
        if len(lengths) > 1:
            raise ValueError(
                f"{self.path}: trajectories have {min(lengths)} to {max(lengths)} frames; "
                "read them one at a time with trajectory(i) or frames()"
            )

    def _chunk(self, c: int) -> dict[str, torch.Tensor]:
        if self._cache is None or self._cache[0] != c:
            self._cache = (c, load_file(str(self.path / self.index["chunks"][c]["file"])))
        return self._cache[1]


@dataclass
class Window:
    """K context frames, the K+F-1 actions up to the last predicted frame, and F future frames.

    ``context uint8 [K, H, W, 3]``, ``actions float32 [K+F-1, A]`` (``actions[t]``
    leads from frame ``t`` to ``t+1`` of the window), ``future uint8 [F, H, W, 3]``.
    """

    context: np.ndarray
    actions: np.ndarray
    future: np.ndarray
    source: str
    start: int


class WindowDataset:
    """All windows of ``context + future`` consecutive frames, every ``stride`` frames."""

    def __init__(self, source: TrajectorySource, context: int, future: int = 1, stride: int = 1):
        if context < 1 or future < 1 or stride < 1:
            raise ValueError(
                f"need context, future, stride >= 1, found {context}, {future}, {stride}"
            )
        self.source, self.context, self.future = source, context, future
        self.info = source.info
        span = context + future
        self._items: list[tuple[int, int]] = []
        for i in range(len(source)):
            n_frames = source.num_frames(i)
            self._items += [(i, s) for s in range(0, n_frames - span + 1, stride)]
        if not self._items:
            raise ValueError(
                f"no trajectory has the {span} frames a window of {context}+{future} needs"
            )

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, k: int) -> Window:
        i, s = self._items[k]
        traj = self.source.trajectory(i)
        k_, f_ = self.context, self.future
        return Window(
            context=traj.frames[s : s + k_],
            actions=traj.actions[s : s + k_ + f_ - 1],
            future=traj.frames[s + k_ : s + k_ + f_],
            source=traj.source,
            start=s,
        )

    def __iter__(self) -> Iterator[Window]:
        return (self[k] for k in range(len(self)))
