"""Pretraining data: the train/val/test trajectory datasets and their token sequences.

``data.env`` generates trajectories from a registered environment; ``data.videos``
imports a folder of recorded videos (:mod:`mmrl.worldmodel.video_import`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmrl.worldmodel.data import TrajectoryDataset, generate_splits
from mmrl.worldmodel.envs import make_env
from mmrl.worldmodel.token_lm import TokenWorldModelProcessor
from mmrl.worldmodel.tokenizer import VQTokenizer
from mmrl.worldmodel.video_import import VideoSource, check_not_video_folder, import_videos

if TYPE_CHECKING:
    from mmrl.worldmodel.pretrain_config import PretrainConfig

IGNORE = -100


@dataclass
class DataSection(VideoSource):
    """Where pretraining data comes from: ``env`` generates it, ``videos`` (the
    :class:`VideoSource` keys) imports recordings instead."""

    env: str = "grid"
    env_config: dict[str, Any] = field(default_factory=dict)
    dir: str = "outputs/worldmodel/grid/data"
    train_trajectories: int = 256
    val_trajectories: int = 32
    test_trajectories: int = 32  # read only by the final base-vs-RL comparison
    length: int = 16
    context: int = 2
    future: int = 1
    # "prompt": all K+F-1 actions in the prompt. "interleaved": the response is
    # v(f_K) <action> A(a_K) <frame> v(f_K+1) ..., the actions teacher-forced (never learned).
    action_form: str = "prompt"


def prepare_data(cfg: PretrainConfig) -> tuple[Path, Path, Path]:
    """The train, held-out (val) and test trajectory datasets under ``data.dir``.

    From ``data.videos``: the videos imported and split by episode (test always present).
    From ``data.env``: generated unless they exist (seeds ``seed``, ``seed+1``, ``seed+2``).
    Checks come first, so bad input writes nothing.
    """
    d, root = cfg.data, Path(cfg.data.dir)
    videos = d.folders()
    for key, folder in (("data.dir", root), ("output_dir", cfg.output_dir)):
        check_not_video_folder(folder, key, videos)
    if d.videos:
        splits = import_videos(d.video_split(cfg.seed), d.video_options(), root, cfg.progress_bar)
        return splits["train"], splits["val"], splits["test"]
    env = make_env(d.env, **d.env_config)
    sizes = {"train": d.train_trajectories, "val": d.val_trajectories, "test": d.test_trajectories}
    dirs = generate_splits(env, sizes, d.length, root, cfg.seed, cfg.progress_bar)
    return dirs["train"], dirs["val"], dirs["test"]


def encode_sequences(
    dataset_dir: Path, tokenizer: VQTokenizer, processor: TokenWorldModelProcessor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every window of a dataset as ``input_ids [M, L]`` and ``labels [M, L]`` (all windows have
    length L).

    Labels are the response's visual ids and the visual ids of context frames after the first;
    everything else (actions, markers, an interleaved response's forced actions) is -100.
    """
    data = TrajectoryDataset(dataset_dir)
    k, f = processor.context, processor.future
    rows, labels = [], []
    for i in range(len(data)):
        traj = data.trajectory(i)
        codes = tokenizer.encode(traj.frames)
        for s in range(len(codes) - k - f + 1):
            actions = traj.actions[s : s + k + f - 1]
            prompt = processor.build_prompt(codes[s : s + k], actions)
            response = processor.build_response(codes[s + k : s + k + f], actions)
            ids = np.array(prompt + response)
            learn = np.concatenate([processor.label_mask(prompt), processor.response_visual_mask()])
            rows.append(ids)
            labels.append(np.where(learn, ids, IGNORE))
    if not rows:
        raise ValueError(
            f"{dataset_dir}: no trajectory has the {k + f} frames a window of {k} context + "
            f"{f} future frames needs; use longer videos or a smaller data.context/future"
        )
    return torch.from_numpy(np.stack(rows)), torch.from_numpy(np.stack(labels))


def changed_tokens(ids: torch.Tensor, processor: TokenWorldModelProcessor) -> torch.Tensor:
    """bool ``[M, L]``: the visual ids that differ from the id at the same place in the frame
    before (every window has the same layout, so the visual positions are read from the
    first). Where nothing moves these are few: on the grid world 2 of 64 when the agent
    steps, so MLE spends almost all its signal on copying and little on the motion."""
    layout = processor.layout
    first = ids[0]
    visual = (first >= layout.visual_offset) & (first < layout.action_offset)
    frames = torch.nonzero(visual).reshape(-1, layout.tokens_per_frame)
    changed = torch.zeros_like(ids, dtype=torch.bool)
    changed[:, frames[1:].reshape(-1)] = (
        ids[:, frames[1:].reshape(-1)] != ids[:, frames[:-1].reshape(-1)]
    )
    return changed


def video_keys(cfg: PretrainConfig) -> dict[str, str]:
    """The current content key of each video split (file names, sizes, mtimes, options);
    empty for environment data. Cheap: nothing is decoded."""
    from mmrl.worldmodel.video_import import files_key, split_videos

    if not cfg.data.videos:
        return {}
    files = split_videos(cfg.data.video_split(cfg.seed))
    return {name: files_key(paths, cfg.data.video_options()) for name, paths in files.items()}
