"""Where a push-world model loses to copying the last frame: windows with discs in contact.

    python -m benchmarks.push_contacts --model outputs/push_km_cw1_more/token_wm/best \
        --tokenizer outputs/push_km_cw1_more/tokenizer --data videos/push/test

Greedy next frames of a token world model on held-out push windows, scored by LPIPS beside
copying the last context frame (through the tokenizer, as in every table), split by whether
two discs are within ``--near`` pixels in the last context frame or the true next frame.
Prints each split's share of the windows and of the model's LPIPS deficit, and how often a
disc is drawn with less than half of its true pixels (lost, merged or recoloured).
"""

from __future__ import annotations

import argparse

import numpy as np

from mmrl.processors.worldmodel import WorldModelPromptProcessor, load_windows
from mmrl.tasks.worldmodel_eval import (
    frame_scores,
    generate,
    load_checkpoint,
    open_trajectories,
    through_tokenizer,
)
from mmrl.worldmodel.envs.base import nearest_palette
from mmrl.worldmodel.envs.push import BACKGROUND, BODY_COLOURS


def body_labels(frames: np.ndarray, bodies: int) -> np.ndarray:
    """``int [N, H, W]``: 0 for background, b for body b (the nearest palette colour)."""
    return nearest_palette(frames, np.array([BACKGROUND, *BODY_COLOURS[:bodies]], np.uint8))


def body_pixels(labels: np.ndarray, bodies: int) -> np.ndarray:
    """``int [N, bodies]``: pixels drawn in each body's colour."""
    return np.stack([(labels == b).sum((1, 2)) for b in range(1, bodies + 1)], 1)


def closest_pair(labels: np.ndarray, bodies: int) -> np.ndarray:
    """``float [N]``: the smallest distance between two bodies' pixel centroids (inf if < 2)."""
    out = np.full(len(labels), np.inf)
    for i, frame in enumerate(labels):
        centres = [np.argwhere(frame == b).mean(0) for b in range(1, bodies + 1)]
        centres = [c for c in centres if np.isfinite(c).all()]
        pairs = [np.linalg.norm(a - b) for j, a in enumerate(centres) for b in centres[j + 1 :]]
        out[i] = min(pairs, default=np.inf)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a token world-model checkpoint")
    p.add_argument("--tokenizer", help="its VQ tokenizer (default: the checkpoint's own)")
    p.add_argument("--data", required=True, help="held-out push recordings or trajectories")
    p.add_argument("--windows", type=int, default=128)
    p.add_argument("--bodies", type=int, default=3, help="agent + objects in the recordings")
    p.add_argument("--near", type=float, default=8.0, help="pixels between disc centres")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    model, processor, tokenizer = load_checkpoint(args.model, args.tokenizer)
    windows = load_windows(
        open_trajectories(args.data), processor.context, processor.future, args.windows, args.seed
    )
    prompts = WorldModelPromptProcessor(processor, tokenizer).encode_windows(windows)
    responses = generate(model, prompts, processor, greedy=True)
    greedy = processor.decode_frames(responses.tolist(), tokenizer)[0][:, :1]
    truth = windows.future[:, :1]
    last = windows.context[:, -1]
    copy = through_tokenizer(tokenizer, last)[:, None]
    ok = np.ones(len(truth), bool)
    model_lpips = frame_scores(greedy, truth, ok, None)["lpips"]
    copy_lpips = frame_scores(copy, truth, ok, None)["lpips"]
    deficit = model_lpips - copy_lpips

    n = args.bodies
    true_labels = body_labels(truth[:, 0], n)
    near = np.minimum(closest_pair(true_labels, n), closest_pair(body_labels(last, n), n))
    near = near < args.near
    true_px = body_pixels(true_labels, n)
    print(f"{len(truth)} windows of {args.data}; next frame, greedy; LPIPS (lower is better)\n")
    print("| windows | share | model | copy last frame | share of the model's deficit |")
    print("|---|---|---|---|---|")
    for name, rows in ((f"discs within {args.near:g} px", near), ("the others", ~near)):
        print(
            f"| {name} | {rows.mean():.3f} | {model_lpips[rows].mean():.4f} | "
            f"{copy_lpips[rows].mean():.4f} | {deficit[rows].sum() / deficit.sum():.2f} |"
        )
    print(f"| all | 1.000 | {model_lpips.mean():.4f} | {copy_lpips.mean():.4f} | 1.00 |\n")
    tokens_truth = through_tokenizer(tokenizer, truth[:, 0])
    for name, frames in (("model", greedy[:, 0]), ("copy last frame", copy[:, 0]),
                         ("true tokens", tokens_truth)):  # fmt: skip
        px = body_pixels(body_labels(frames, n), n)
        lost = (px < 0.5 * true_px).any(1).mean()
        print(f"{name}: a disc drawn with < half its pixels in {lost:.3f} of frames")


if __name__ == "__main__":
    main()
