"""Recorded-video test data: mp4 episodes of a square driven by 3-dim continuous actions."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mmrl.worldmodel.video import write_mp4

# The small recipe of the slow test and its benchmark (benchmarks/bench_worldmodel_videos.py):
# 24 episodes of 16 frames at 48x64, F=2, a light tokenizer, 300 MLE steps, 20 GRPO steps.
EPISODES, FRAMES, SHAPE = 24, 16, (48, 64)
PRETRAIN = [
    "data.future=2",
    "tokenizer.model.kind=conv",  # the small recipe the test's LPIPS margin was measured on
    "tokenizer.model.block_out_channels=[8,16,16,16]",
    "tokenizer.model.norm_num_groups=4",
    "tokenizer.train.steps=150",
    "tokenizer.train.batch_size=16",
    "model.num_hidden_layers=2",
    "train.steps=300",
    "train.lr=2e-3",  # the lr the margin was measured at (the default is now 1e-3)
    "train.min_lr_ratio=1.0",
    "train.change_weight=1.0",
    "train.min_delta=0.005",
    "train.patience=3",
    "train.val_every=100",
    "train.val_windows=64",
    "train.eval_windows=16",
]
RL = [
    # The precision and row layout the margin was measured with; on a CPU with bf16
    # instructions auto would train in bf16, and one seed's small LPIPS gain is not robust to
    # that rounding (on a CPU with bf16, seed 0 measured +0.0030 in bf16 with packed rows and
    # -0.0052 in fp32, from an earlier pretrained start).
    "trainer.mixed_precision=fp32",
    "actor_rollout_ref.model.remove_padding=false",
    "data.max_response_length=96",
    "trainer.progress_bar=false",
    "trainer.loggers=[jsonl]",
    "trainer.total_steps=20",
    "trainer.test_freq=10",
    "task.val_windows=16",
    "task.eval.windows=64",
    # 2 samples per window left the sampled LPIPS of one model 0.0055 apart between evaluation
    # seeds, more than GRPO's gain; 8 bring that to 0.0014 (docs/benchmarks.md).
    "task.eval.samples=8",
]


def train_args(videos: Path, pretrain_dir: Path, run_dir: Path, seed: int) -> list[str]:
    """``mmrl train`` arguments of the small recipe, reusing the pretraining in
    ``pretrain_dir`` (made by ``mmrl pretrain-worldmodel`` with the same settings)."""
    return [
        "train",
        "task=worldmodel_videos",
        f"task.pretrain.data.videos={videos}",
        f"++task.pretrain.output_dir={pretrain_dir}",
        *(f"++task.pretrain.{o}" for o in PRETRAIN),
        f"trainer.output_dir={run_dir}",
        f"trainer.seed={seed}",
        *RL,
    ]


def square_episode(
    rng: np.random.Generator, t: int = 8, shape: tuple[int, int] = (48, 64)
) -> tuple[np.ndarray, np.ndarray]:
    """``frames uint8 [t, H, W, 3]`` and ``actions float32 [t-1, 3]``: an 8x8 square moves by
    ``4 * (a0, a1)`` pixels per step (stopping at the walls) and ``a2`` sets its brightness."""
    actions = rng.uniform(-1, 1, (t - 1, 3)).astype(np.float32)
    frames = np.full((t, *shape, 3), 24, np.uint8)
    y, x = shape[0] // 2 - 4, shape[1] // 2 - 4
    for i in range(t):
        level = 170
        if i:
            y = int(np.clip(y + round(4 * actions[i - 1, 1]), 0, shape[0] - 8))
            x = int(np.clip(x + round(4 * actions[i - 1, 0]), 0, shape[1] - 8))
            level = 170 + int(round(60 * actions[i - 1, 2]))
        frames[i, y : y + 8, x : x + 8] = (level, 90, 40)
    return frames, actions


def write_episodes(
    folder: Path,
    n: int,
    t: int = 8,
    shape: tuple[int, int] = (48, 64),
    fps: float = 10,
    seed: int = 0,
    sidecar: str = "{stem}.npy",
) -> Path:
    """``n`` episodes ``ep00.mp4, ...`` with their actions (``sidecar`` pattern) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        frames, actions = square_episode(rng, t, shape)
        write_mp4(folder / f"ep{i:02d}.mp4", frames, fps=fps)
        np.save(folder / sidecar.format(stem=f"ep{i:02d}"), actions)
    return folder
