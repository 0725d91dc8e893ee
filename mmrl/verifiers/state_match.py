"""State match: read the state a predicted frame shows, compare it with the true one.

Environments' renderers have exact inverses (``env.state_from_frame``), so a predicted
frame can be judged by what it means rather than by its pixels: did the agent (and
each object) end up where it really did? The truth is read from ``gt_frames`` by the
same inverse, which equals the true observed state exactly.

Per frame, a predicted state matches when it is valid (the frame shows one
consistent state) and every observed field equals the truth, or, for fields of
integer positions (the push world's ``pixels``), lies within ``tolerance`` pixels
per coordinate. Scores are the fraction of matching frames (or ``aggregate`` of the
per-frame 0/1 values), so the verifier can serve as a reward or a metric.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmrl.protocol import Batch
from mmrl.verifiers.base import VerifierOutput, register_verifier
from mmrl.verifiers.frames import aggregate_frames, frame_pairs

POSITION_FIELDS = ("pixels", "agent")


def frame_state_match(
    env: Any, pred: np.ndarray, truth: np.ndarray, tolerance: int = 0
) -> tuple[bool, float]:
    """``(match, position_error)`` of one predicted ``uint8 [H, W, 3]`` frame against the true one.

    ``position_error`` is the largest absolute coordinate difference of the positions
    (``inf`` when the predicted frame shows no valid state).
    """
    p, t = env.state_from_frame(pred), env.state_from_frame(truth)
    if not bool(p.get("valid", True)):
        return False, float("inf")
    error, match = 0.0, True
    for key, value in t.items():
        if key == "valid":
            continue
        if key in POSITION_FIELDS:
            err = float(np.abs(np.asarray(p[key]) - np.asarray(value)).max())
            error = max(error, err)
            match &= err <= tolerance
        else:
            match &= bool(np.array_equal(p[key], value))
    return bool(match), error


@register_verifier("state_match")
def state_match(
    batch: Batch,
    env: str = "push",
    env_config: dict[str, Any] | None = None,
    tolerance: int = 0,
    aggregate: str = "mean",
    gamma: float = 0.9,
) -> VerifierOutput:
    """Fraction of each sample's F predicted frames whose state matches the truth's.

    env / env_config: the registered environment that rendered the frames.
    tolerance: allowed position error in pixels (0: exact).
    Metrics: ``position_error`` (mean over frames, invalid frames count as the frame size)
    and ``valid_state`` (fraction of predicted frames that show a consistent state).
    """
    from mmrl.worldmodel.envs import make_env

    world = make_env(env, **(env_config or {}))
    pred, gt = frame_pairs(batch)
    pred_u8 = (pred * 255).round().to(torch.uint8).cpu().numpy()
    gt_u8 = (gt * 255).round().to(torch.uint8).cpu().numpy()
    b, f = pred_u8.shape[:2]
    matches, errors = np.zeros((b, f)), np.zeros((b, f))
    for i in range(b):
        for j in range(f):
            matches[i, j], errors[i, j] = frame_state_match(
                world, pred_u8[i, j], gt_u8[i, j], tolerance
            )
    valid_state = np.isfinite(errors)
    errors = np.minimum(errors, float(max(pred_u8.shape[2:4])))
    scores = aggregate_frames(torch.from_numpy(matches), aggregate, gamma).numpy()
    return VerifierOutput(
        scores=scores,
        valid=np.ones(b, dtype=bool),
        metrics={"position_error": errors.mean(1), "valid_state": valid_state.mean(1)},
    )
