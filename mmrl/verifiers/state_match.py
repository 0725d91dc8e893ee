"""State match: read the state a predicted frame shows, compare it with the true one.

Environments' renderers have exact inverses (``env.state_from_frame``), so a predicted
frame can be judged by what it means rather than by its pixels: did the agent (and
each object) end up where it really did? The truth is read from ``gt_frames`` by the
same inverse, which equals the true observed state exactly.

This is the one state-match rule: the reward verifier and the held-out evaluation
(:mod:`mmrl.tasks.worldmodel_eval`) both call
:func:`~mmrl.worldmodel.envs.frame_state_match`.

Per frame, a predicted state matches when it is valid (the frame shows one
consistent state) and every observed field equals the truth, or, for fields of
integer positions (the push world's ``pixels``), lies within ``tolerance`` pixels
per coordinate. Scores are the fraction of matching frames (or ``aggregate`` of the
per-frame 0/1 values), so the verifier can serve as a reward or a metric.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from mmrl.protocol import Batch
from mmrl.verifiers.base import VerifierOutput, register_verifier
from mmrl.verifiers.frames import aggregate_frames, frame_pairs
from mmrl.worldmodel.envs import frame_state_match

__all__ = ["frame_state_match", "state_match"]


@register_verifier("state_match")
def state_match(
    batch: Batch,
    env: str | None = None,
    env_config: dict[str, Any] | None = None,
    tolerance: int = 0,
    aggregate: str = "mean",
    gamma: float = 0.9,
) -> VerifierOutput:
    """Fraction of each sample's F predicted frames whose state matches the truth's.

    The environment is the sample's own (non-tensor field ``env``: ``{"name", "config"}``,
    set by the world-model processors) or, without that field, ``env``/``env_config``.
    The truth is the sample's recorded observed states (non-tensor ``ground_truth``: one
    state per future frame) when present, else read from ``gt_frames``. A sample with an
    undecodable prediction (NaN frames) is invalid, not a mismatch.

    tolerance: allowed position error in pixels (0: exact).
    Metrics: ``position_error`` (mean over frames, invalid frames count as the frame size)
    and ``valid_state`` (fraction of predicted frames that show a consistent state).
    """
    pred, gt = frame_pairs(batch)
    b, f = pred.shape[:2]
    decodable = ~torch.isnan(pred.reshape(b, -1)).any(1).cpu().numpy()
    pred_u8 = (pred.nan_to_num(0.0) * 255).round().to(torch.uint8).cpu().numpy()
    gt_u8 = (gt * 255).round().to(torch.uint8).cpu().numpy()
    worlds = _environments(batch, env, env_config)
    truths = batch.non_tensor.get("ground_truth")
    matches, errors = np.zeros((b, f)), np.zeros((b, f))
    for i in range(b):
        for j in range(f):
            truth = truths[i][j] if truths is not None else None
            matches[i, j], errors[i, j] = frame_state_match(
                worlds[i], pred_u8[i, j], gt_u8[i, j], tolerance, truth
            )
    valid_state = np.isfinite(errors)
    errors = np.minimum(errors, float(max(pred_u8.shape[2:4])))
    scores = aggregate_frames(torch.from_numpy(matches), aggregate, gamma).numpy()
    return VerifierOutput(
        scores=np.where(decodable, scores, np.nan),
        valid=decodable,
        metrics={"position_error": errors.mean(1), "valid_state": valid_state.mean(1)},
    )


def _environments(batch: Batch, env: str | None, env_config: dict[str, Any] | None) -> list:
    """One environment per sample: the batch's ``env`` specs, else the ``env`` kwarg."""
    from mmrl.worldmodel.envs import make_env

    specs = batch.non_tensor.get("env")
    if specs is None:
        if env is None:
            raise ValueError(
                "state_match needs the environment that rendered the frames: a non-tensor "
                "field 'env' ({'name', 'config'} per sample) or kwargs {env: <name>}"
            )
        return [make_env(env, **(env_config or {}))] * len(batch)
    made: dict[str, Any] = {}
    out = []
    for spec in specs:
        key = json.dumps(spec, sort_keys=True, default=str)
        if key not in made:
            made[key] = make_env(spec["name"], **dict(spec.get("config") or {}))
        out.append(made[key])
    return out
