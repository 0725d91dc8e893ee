"""Latent world-model prompts: context frames + actions in, AE latents; latents out, frames.

A prompt is one window of a trajectory: K context frames, the K+F-1 actions that lead
to its last future frame, and the F true future frames (the verifiers' targets). The
processor encodes the context frames with the latent autoencoder; the latent rollout
engine (:mod:`mmrl.models.latent_family`) samples F future latents; :meth:`decode` turns them
back into frames for the frame verifiers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.protocol import Batch
from mmrl.sampling import FRAME_END_KEY
from mmrl.worldmodel.data import TrajectoryDataset
from mmrl.worldmodel.latent_ae import LatentAutoencoder
from mmrl.worldmodel.windows import FrameWindows, longest_trajectory


def frame_windows(
    dataset_dir: str | Path, context: int, future: int, max_windows: int | None = None
) -> FrameWindows:
    """Every window of a trajectory dataset (or ``max_windows`` of them, evenly spaced, in
    order). Trajectories may differ in length (recorded episodes); one shorter than
    ``context + future`` gives no window."""
    data = TrajectoryDataset(dataset_dir)
    span = context + future
    starts = [(i, s) for i in range(len(data)) for s in range(data.num_frames(i) - span + 1)]
    if not starts:
        longest = longest_trajectory(data)
        raise ValueError(
            f"{dataset_dir}: the longest trajectory has {longest} frames, fewer than context + "
            f"future = {span}"
        )
    if max_windows is not None and max_windows < len(starts):
        pick = np.linspace(0, len(starts) - 1, max_windows).round().astype(int)
        starts = [starts[j] for j in pick]
    context_frames, actions, future_frames = [], [], []
    for i, s in starts:
        traj = data.trajectory(i)  # consecutive windows share a trajectory: one read each
        context_frames.append(traj.frames[s : s + context])
        actions.append(traj.actions[s : s + span - 1])
        future_frames.append(traj.frames[s + context : s + span])
    seeds = data.index["seeds"]
    env = {"name": data.info.env, "config": dict(data.index.get("env_config", {}))}
    return FrameWindows(
        context=np.stack(context_frames),
        actions=np.stack(actions).astype(np.float32),
        future=np.stack(future_frames),
        env=env if data.info.env else None,
        sources=[{"trajectory": i, "seed": int(seeds[i]), "start": s} for i, s in starts],
    )


class LatentWorldModelProcessor:
    """Encodes :class:`FrameWindows` into latent prompts and decodes sampled latents into frames."""

    def __init__(self, ae: LatentAutoencoder, context: int, future: int) -> None:
        self.ae, self.context, self.future = ae, context, future

    def encode_dataset(self, windows: FrameWindows, split: str) -> Batch:
        """``context_latents [M, K, C, h, w]``, ``actions [M, K+F-1, A]``, ``gt_frames uint8 [M, F,
        H, W, 3]``,
        ``attention_mask``/``position_ids [M, K]`` (one position per context frame),
        ``extra_info``."""
        if len(windows) == 0:
            raise ValueError(f"the {split} set has no windows: check the task's data settings")
        m, k = windows.context.shape[:2]
        f = windows.future.shape[1]
        if (k, f) != (self.context, self.future) or windows.actions.shape[1] != k + f - 1:
            raise ValueError(
                f"{split} windows have {k} context frames, {f} future frames and "
                f"{windows.actions.shape[1]} "
                f"actions; the processor expects {self.context}, {self.future} and "
                f"{self.context + self.future - 1}"
            )
        latents = self.ae.encode(windows.context.reshape(-1, *windows.context.shape[2:]))
        mask = torch.ones(m, k, dtype=torch.long)
        return Batch.from_dict(
            tensors={
                "context_latents": latents.reshape(m, k, *latents.shape[1:]),
                "actions": torch.from_numpy(windows.actions),
                "gt_frames": torch.from_numpy(windows.future),
                "last_context_frame": torch.from_numpy(windows.context[:, -1].copy()),
                "attention_mask": mask,
                "position_ids": torch.arange(k).expand(m, k).clone(),
                FRAME_END_KEY: torch.arange(f).expand(m, f).clone(),  # one step per frame
            },
            non_tensor={"extra_info": _infos(windows.sources)},
            meta={"num_filtered_prompts": 0},
        )

    def decode(self, batch: Batch) -> Batch:
        """Add ``pred_frames uint8 [B, F, H, W, 3]``: the response latents through the AE
        decoder."""
        latents = batch["response_latents"]
        b, f = latents.shape[:2]
        frames = self.ae.decode(latents.detach().float().cpu().flatten(0, 1))
        batch["pred_frames"] = torch.from_numpy(frames).reshape(b, f, *frames.shape[1:])
        return batch

    def sampling_overrides(self) -> dict[str, Any]:
        """Exactly F latent steps per response."""
        return {"max_tokens": self.future, "min_tokens": self.future}


def _infos(sources: Any) -> np.ndarray:
    """One ``extra_info`` dict per window (a string source becomes ``{"source": ...}``)."""
    out = np.empty(len(sources), dtype=object)
    for i, s in enumerate(sources):
        out[i] = dict(s) if isinstance(s, dict) else {"source": s}
    return out
