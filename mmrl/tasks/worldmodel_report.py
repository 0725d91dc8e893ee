"""The pictures of a world-model RL run, for its run report (``report.html``, which also
shows the curves and the held-out table per future step from ``worldmodel_eval.json``).

``write_report(out_dir, comparison, windows)`` writes into ``out_dir``:

- ``frames.png``: one row per held-out window (those where the frame changes most): context
  frames | ground-truth future | base prediction | RL prediction (greedy);
- ``rollout.gif``: the same windows animated, ground truth | base | RL side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def showcase(windows: Any, n: int) -> np.ndarray:
    """Indices of the ``n`` windows whose future differs most from their last context frame
    (where the dynamics show), in data order."""
    change = np.abs(windows.future.astype(np.int32) - windows.context[:, -1:].astype(np.int32)).sum(
        (1, 2, 3, 4)
    )
    return np.sort(np.argsort(-change, kind="stable")[:n])


def frame_strip(
    windows: Any, base: np.ndarray, rl: np.ndarray, rows: int, scale: int = 3
) -> np.ndarray:
    """uint8 image: per window, context | truth | base | RL frames with 2 px gaps, upscaled."""
    h = windows.future.shape[2]
    gap = np.full((h, 2, 3), 255, np.uint8)
    lines = []
    for i in showcase(windows, rows):
        parts = [*windows.context[i], gap, *windows.future[i], gap, *base[i], gap, *rl[i]]
        lines.append(np.concatenate(parts, axis=1))
        lines.append(np.full((2, lines[-1].shape[1], 3), 255, np.uint8))
    image = np.concatenate(lines[:-1], axis=0)
    return image.repeat(scale, 0).repeat(scale, 1)


def write_gif(
    windows: Any, base: np.ndarray, rl: np.ndarray, path: Path, n: int = 8, scale: int = 4
) -> Path:
    """Frames of ``n`` windows in turn: context frames, then truth | base | RL side by side."""
    from PIL import Image

    gap = np.full((windows.future.shape[2], 2, 3), 255, np.uint8)
    images = []
    for i in showcase(windows, n):
        for c in windows.context[i]:
            images.append(np.concatenate([c, gap, c, gap, c], axis=1))
        for t in range(windows.future.shape[1]):
            images.append(
                np.concatenate([windows.future[i, t], gap, base[i, t], gap, rl[i, t]], axis=1)
            )
    frames = [Image.fromarray(im.repeat(scale, 0).repeat(scale, 1)) for im in images]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=350, loop=0)
    return path


def write_report(out_dir: Path, comparison: dict[str, Any], windows: Any, rows: int = 8) -> Path:
    """Write ``frames.png`` and ``rollout.gif`` into ``out_dir``; returns ``out_dir``."""
    from PIL import Image

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base, rl = comparison["predictions"]["base"], comparison["predictions"]["rl"]
    Image.fromarray(frame_strip(windows, base, rl, rows)).save(out_dir / "frames.png")
    write_gif(windows, base, rl, out_dir / "rollout.gif")
    return out_dir
