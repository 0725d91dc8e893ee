"""Recordings of the project's environments as a user's folder of videos: one mp4 per episode
(written by ``write_mp4``, PyAV) with its actions in ``<stem>.npy``.

    python -m benchmarks.env_videos grid outputs/videos/grid --episodes 320 --length 16

The grid world is rendered at 64x64 (8x8 cells of 8 px) and the push world in a 64x64 box,
with continuous 2-dim actions, as the world-model benchmarks use them (``--size`` for
another side, e.g. 32). The environments'
own exploration policies choose the actions.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from mmrl.worldmodel.data import rollout
from mmrl.worldmodel.envs import make_env
from mmrl.worldmodel.video import write_mp4


def env_at(name: str, size: int):
    """The environment rendered at ``size`` x ``size`` (the grid world has 8 x 8 cells)."""
    return make_env(name, **({"cell": size // 8} if name == "grid" else {"size": size}))


def write_env_videos(
    env_name: str,
    folder: Path,
    episodes: int,
    length: int,
    seed: int = 0,
    fps: float = 10,
    size: int = 64,
) -> Path:
    """``episodes`` mp4 files ``ep00000.mp4, ...`` of ``length`` frames, with actions."""
    env = env_at(env_name, size)
    folder.mkdir(parents=True, exist_ok=True)
    seeds = np.random.default_rng(seed).integers(0, 2**31 - 1, episodes)
    for i, env_seed in enumerate(tqdm(seeds, desc=f"{env_name} videos")):
        frames, actions = rollout(env, int(env_seed), length)
        write_mp4(folder / f"ep{i:05d}.mp4", frames, fps=fps)
        np.save(folder / f"ep{i:05d}.npy", actions)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("env", choices=["grid", "push"])
    p.add_argument("folder", type=Path)
    p.add_argument("--episodes", type=int, default=320)
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=64, help="frame side in pixels")
    args = p.parse_args()
    write_env_videos(args.env, args.folder, args.episodes, args.length, args.seed, size=args.size)


if __name__ == "__main__":
    main()
