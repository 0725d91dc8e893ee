"""The report of a world-model RL run: Markdown, curves, frame strips and a GIF.

``write_report(out_dir, history, comparison, windows)`` writes into ``out_dir``:

- ``README.md``: the held-out table (base vs RL, greedy and sampled) and the pictures;
- ``curves.png``: reward, KL loss, entropy (training samples) and PSNR, LPIPS
  (held-out validation) over RL steps;
- ``frames.png``: one row per held-out window (those where the frame changes most): context frames |
  ground-truth future |
  base prediction | RL prediction (greedy);
- ``rollout.gif``: the same windows animated, ground truth | base | RL side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mmrl.tasks.worldmodel_eval import format_steps, format_table

CURVES = (  # (title, metric keys tried in order)
    ("reward -(MAE+LPIPS)", ("critic/score/mean",)),
    ("KL to reference", ("actor/kl_loss", "actor/ppo_kl")),
    ("entropy (nats/token)", ("actor/entropy",)),
    ("held-out PSNR dB (greedy)", ("val/psnr/mean",)),
    ("held-out LPIPS (greedy)", ("val/lpips/mean",)),
)


def plot_curves(history: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2))
    for ax, (title, keys) in zip(axes, CURVES, strict=True):
        for key in keys:
            pts = [(row["step"], row[key]) for row in history if row.get(key) is not None]
            if pts:
                xs, ys = (np.asarray(v) for v in zip(*pts, strict=True))
                if len(pts) < 20:
                    ax.plot(xs, ys, marker="o", ms=3)
                else:  # noisy per-step values: raw, and a 10-step running mean
                    ax.plot(xs, ys, alpha=0.35)
                    ax.plot(
                        xs[9:],
                        np.convolve(ys, np.ones(10) / 10, mode="valid"),
                        label="10-step mean",
                    )
                    ax.legend(fontsize=7)
                break
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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


def write_report(
    out_dir: Path, history: list[dict], comparison: dict[str, Any], windows: Any, rows: int = 8
) -> Path:
    """Write the report folder; returns the path of its ``README.md``."""
    from PIL import Image

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_curves(history, out_dir / "curves.png")
    base, rl = comparison["predictions"]["base"], comparison["predictions"]["rl"]
    Image.fromarray(frame_strip(windows, base, rl, rows)).save(out_dir / "frames.png")
    write_gif(windows, base, rl, out_dir / "rollout.gif")
    table = comparison["table"]
    rows_md = {f"{m} ({d})": table[m][d] for d in ("greedy", "sampled") for m in ("base", "rl")}
    k, f = windows.context.shape[1], windows.future.shape[1]
    text = [
        "# World-model RL report",
        "",
        f"Held-out windows: {len(windows)} (trajectories never seen in pretraining or RL); "
        f"{k} context frames, {f} predicted frame(s). base = the pretrained start, rl = after "
        "GRPO; both decoded the same way.",
        "",
        format_table(rows_md, "model (decoding)"),
        "",
        "`repeated`: the fraction of predicted frames that stand still while the true frame "
        "moves (mmrl.verifiers.repetition, the same function as the repetition_penalty "
        "verifier and mmrl eval).",
        "",
        f"## Per future step (t = 1..{f})",
        "",
        format_steps(rows_md, f),
        "",
        "## Curves",
        "",
        "![curves](curves.png)",
        "",
        "## Frames",
        "",
        "Each row: context frames | ground-truth future | base prediction | RL prediction "
        "(greedy).",
        "",
        "![frames](frames.png)",
        "",
        "![rollout](rollout.gif)",
        "",
    ]
    path = out_dir / "README.md"
    path.write_text("\n".join(text))
    return path
