"""Prediction problems as arrays: K context frames, their actions, and the F true future frames.

One type serves the token and the latent world model (their processors encode it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmrl.worldmodel.data import WindowDataset


@dataclass
class FrameWindows:
    """``N`` prediction problems: ``context uint8 [N, K, H, W, 3]``,
    ``actions float32 [N, K+F-1, A]``, ``future uint8 [N, F, H, W, 3]``.

    ``env`` (``{"name", "config"}``) names the environment that rendered the frames,
    or is None for recorded video; ``sources`` says where each window came from (a
    string, or a dict such as ``{"trajectory", "seed", "start"}``).
    """

    context: np.ndarray
    actions: np.ndarray
    future: np.ndarray
    env: dict[str, Any] | None = None
    sources: Sequence[Any] = ()

    def __post_init__(self) -> None:
        n = len(self.context)
        if len(self.actions) != n or len(self.future) != n:
            raise ValueError(
                f"windows disagree on their count: {n} contexts, {len(self.actions)} action "
                f"rows, {len(self.future)} futures"
            )
        if not self.sources:
            self.sources = [f"window {i}" for i in range(n)]

    def __len__(self) -> int:
        return len(self.context)

    def __getitem__(self, idx: Any) -> FrameWindows:
        idx = np.arange(len(self))[idx]
        return FrameWindows(
            self.context[idx],
            self.actions[idx],
            self.future[idx],
            self.env,
            [self.sources[i] for i in np.atleast_1d(idx)],
        )


def longest_trajectory(source: Any) -> int:
    """Frames in the longest trajectory of ``source`` (0 when it holds none)."""
    return max((source.num_frames(i) for i in range(len(source))), default=0)


def load_windows(
    source: Any,
    context: int,
    future: int,
    n: int | None = None,
    seed: int = 0,
    env: dict[str, Any] | None = None,
) -> FrameWindows:
    """Every window of ``context + future`` frames of a trajectory source (a
    ``TrajectoryDataset`` or ``VideoDataset``), or ``n`` of them drawn with ``seed``.

    ``env`` defaults to the source's own environment (``index["env"]``/``env_config``).
    """
    windows = WindowDataset(source, context, future)
    pick = np.arange(len(windows))
    if n is not None and n < len(windows):
        pick = np.sort(np.random.default_rng(seed).permutation(len(windows))[:n])
    items = [windows[int(i)] for i in pick]
    if env is None and getattr(source, "index", None) and source.index.get("env"):
        env = {"name": source.index["env"], "config": dict(source.index.get("env_config", {}))}
    return FrameWindows(
        np.stack([w.context for w in items]),
        np.stack([w.actions for w in items]).astype(np.float32),
        np.stack([w.future for w in items]),
        env,
        [f"{w.source}@{w.start}" for w in items],
    )
