"""Two example verifiers, installed as entry points in the group ``mmrl.verifiers``.

``brightness_match`` is vectorised: one call scores the whole batch with tensor ops
on the frames' device. ``keyword_count`` is plain per-sample Python, so it asks to run
in worker processes, where a slow or stuck call is timed out.
"""

from __future__ import annotations

import numpy as np

from mmrl.protocol import Batch
from mmrl.verifiers import VerifierOutput, aggregate_frames, frame_pairs, verifier


def brightness_match(batch: Batch, aggregate: str = "mean") -> VerifierOutput:
    """1 - |mean brightness(pred) - mean brightness(gt)| per sample, in [0, 1].

    Reads ``pred_frames`` / ``gt_frames`` [B, F, H, W, 3] (uint8 or float in [0, 1]).
    """
    pred, gt = frame_pairs(batch)  # float32 [B, F, H, W, 3] in [0, 1]
    per_frame = 1.0 - (pred.mean(dim=(2, 3, 4)) - gt.mean(dim=(2, 3, 4))).abs()  # [B, F]
    scores = aggregate_frames(per_frame, aggregate)  # [B]
    return VerifierOutput(
        scores=scores.cpu().numpy(),
        valid=np.ones(len(batch), dtype=bool),
        metrics={"pred_brightness": pred.mean(dim=(1, 2, 3, 4)).cpu().numpy()},
    )


@verifier(mode="process", timeout_s=10.0)
def keyword_count(batch: Batch, keyword: str = "because") -> list[float]:
    """How often ``keyword`` occurs in each ``response_text``, capped at 3, over 3."""
    return [min(str(text).count(keyword), 3) / 3 for text in batch["response_text"]]
