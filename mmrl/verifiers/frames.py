"""Frames as verifiers see them, and per-frame aggregation for multi-step futures.

Convention: decoded predictions are the tensor field ``pred_frames`` and targets are
``gt_frames``, both ``[B, F, H, W, 3]`` channel-last RGB (``[B, H, W, 3]`` is read as
F = 1). Either uint8 in [0, 255] or floating point in [0, 1]. Verifiers call
:func:`frame_pairs`, which converts both to float32 in [0, 1] on the tensor's device
(uint8 / 255; floats are clamped into [0, 1], which absorbs a decoder's small
overshoot). Frame metrics score each of the F frames and then reduce them to one
score per sample with :func:`aggregate_frames`, or keep one score per frame
(``aggregate=per_frame``: scores [B, F], which the trainer places on each frame's last
response token, so GAE/REINFORCE++ see each reward where its frame ends).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from mmrl.protocol import Batch
from mmrl.verifiers.base import VerifierOutput

AGGREGATIONS = ("mean", "last", "discounted", "per_frame")
PRED_KEY, GT_KEY = "pred_frames", "gt_frames"


def to_unit_float(frames: Tensor, key: str = PRED_KEY) -> Tensor:
    """``frames`` [B, F, H, W, 3] (or [B, H, W, 3]) uint8 or float -> float32 [B, F, H, W, 3] in [0,
    1].
    """
    if frames.ndim not in (4, 5) or frames.shape[-1] != 3:
        raise ValueError(
            f"{key} must be [B, F, H, W, 3] (channel-last RGB), found shape {list(frames.shape)}"
        )
    if frames.ndim == 4:
        frames = frames.unsqueeze(1)
    if frames.dtype == torch.uint8:
        return frames.float() / 255.0
    if not frames.is_floating_point():
        raise TypeError(f"{key} must be uint8 in [0, 255] or float in [0, 1], found {frames.dtype}")
    return frames.float().clamp(0.0, 1.0)  # NaN stays NaN and marks the sample invalid


def frame_pairs(batch: Batch) -> tuple[Tensor, Tensor]:
    """``(pred, gt)``, each float32 [B, F, H, W, 3] in [0, 1] on the predictions' device."""
    for key in (PRED_KEY, GT_KEY):
        if key not in set(batch.keys()):
            raise KeyError(
                f"frame verifiers need tensor fields {PRED_KEY!r} and {GT_KEY!r} [B, F, H, W, 3]; "
                f"{key!r} is missing (tensors: {batch.keys()})"
            )
    pred = to_unit_float(batch[PRED_KEY], PRED_KEY)
    gt = to_unit_float(batch[GT_KEY], GT_KEY).to(pred.device)
    if pred.shape != gt.shape:
        raise ValueError(
            f"{PRED_KEY} {list(pred.shape)} and {GT_KEY} {list(gt.shape)} must have equal shapes"
        )
    return pred, gt


def to_nchw(frames: Tensor) -> Tensor:
    """[B, F, H, W, 3] -> [B * F, 3, H, W] (the layout torchmetrics and conv nets take)."""
    b, f, h, w, c = frames.shape
    return frames.reshape(b * f, h, w, c).permute(0, 3, 1, 2).contiguous()


def aggregate_frames(values: Tensor, how: str = "mean", gamma: float = 0.9) -> Tensor:
    """Reduce per-frame values [B, F] to one value per sample [B].

    ``mean``: the average over frames. ``last``: the final frame only.
    ``discounted``: ``sum_t gamma^t v_t / sum_t gamma^t`` (t = 0 is the first predicted
    frame), a weighted mean that trusts near-term frames more; gamma = 1 is ``mean``.
    ``per_frame``: no reduction, [B, F] (F = 1 gives [B]): per-frame rewards.
    """
    if values.ndim != 2:
        raise ValueError(f"per-frame values must be [B, F], found {list(values.shape)}")
    if how == "per_frame":
        return values[:, 0] if values.shape[1] == 1 else values
    if how == "mean":
        return values.mean(dim=1)
    if how == "last":
        return values[:, -1]
    if how == "discounted":
        if not 0.0 < gamma <= 1.0:
            raise ValueError(f"discount gamma must be in (0, 1], found {gamma}")
        weights = gamma ** torch.arange(values.shape[1], device=values.device, dtype=values.dtype)
        return (values * weights).sum(dim=1) / weights.sum()
    raise ValueError(f"frame aggregation {how!r} is not one of {AGGREGATIONS}")


def score_frames(
    batch: Batch,
    per_frame: Callable[[Tensor, Tensor], Tensor],
    aggregate: str = "mean",
    gamma: float = 0.9,
    chunk_frames: int = 256,
) -> VerifierOutput:
    """Score every predicted frame against its target, then aggregate over frames.

    per_frame: ``(pred [N, 3, H, W], gt [N, 3, H, W]) -> [N]``, both float in [0, 1];
    called on at most ``chunk_frames`` frames at a time to bound memory.
    Returns scores [B] ([B, F] for ``aggregate=per_frame`` and F > 1) and the metrics
    ``first_frame`` / ``last_frame`` [B].
    """
    pred, gt = frame_pairs(batch)
    b, f = pred.shape[:2]
    with torch.inference_mode():
        flat_pred, flat_gt = to_nchw(pred), to_nchw(gt)
        parts = [
            per_frame(flat_pred[i : i + chunk_frames], flat_gt[i : i + chunk_frames])
            for i in range(0, b * f, chunk_frames)
        ]
        values = torch.cat(parts).reshape(b, f).double()
        scores = aggregate_frames(values, aggregate, gamma)
    per_frame_np = values.cpu().numpy()
    return VerifierOutput(
        scores=scores.cpu().numpy(),
        valid=np.ones(b, dtype=bool),
        metrics={"first_frame": per_frame_np[:, 0], "last_frame": per_frame_np[:, -1]},
    )
