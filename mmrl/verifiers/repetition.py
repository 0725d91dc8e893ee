"""Repetition: a predicted future that stands still while the true one moves.

One definition serves the reward verifier, ``mmrl eval`` and the run report
(:func:`repeated_frames`): predicted frame ``t`` is *repeated* when its mean absolute
difference (pixels in [0, 1]) from the previous frame is below ``tau`` while the true
frame's difference from its previous frame is above ``tau``. The frame before the first
predicted one is the last context frame: as the model sees it (through its tokenizer or
autoencoder, ``last_context_decoded``, when given) for the prediction, as recorded for the
truth, so a codec's reconstruction error is not mistaken for motion. The repetition rate
is the fraction of repeated frames among the frames whose truth moved (NaN where none
moved).

A world model trained by maximum likelihood often copies its last frame when unsure;
RLVR-World penalises that with a repetition reward. ``repetition_penalty`` is that
reward: ``-rate`` per sample, 0 when nothing repeats or nothing moved, so give it a
positive weight.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mmrl.protocol import Batch
from mmrl.verifiers.base import VerifierOutput, register_verifier
from mmrl.verifiers.frames import frame_pairs, to_unit_float

LAST_CONTEXT_KEY = "last_context_frame"  # uint8 [B, H, W, 3], set by the world-model processor
DECODED_KEY = "last_context_decoded"  # the same frame through the model's tokenizer (optional)
DEFAULT_TAU = 0.01


def repeated_frames(
    pred: Tensor,
    truth: Tensor,
    last_context: Tensor,
    tau: float = DEFAULT_TAU,
    last_decoded: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(repeated, moved)``, both bool ``[B, F]``, of float frames in [0, 1]: ``pred`` and
    ``truth`` ``[B, F, H, W, 3]``, ``last_context`` (and ``last_decoded``) ``[B, H, W, 3]``."""

    def steps(frames: Tensor, last: Tensor) -> Tensor:
        prev = torch.cat([last[:, None].to(frames), frames[:, :-1]], dim=1)
        return (frames - prev).abs().flatten(2).mean(2)

    moved = steps(truth, last_context) > tau
    before = last_context if last_decoded is None else last_decoded
    return (steps(pred, before) < tau) & moved, moved


def repetition_rate(
    pred: Tensor,
    truth: Tensor,
    last_context: Tensor,
    tau: float = DEFAULT_TAU,
    last_decoded: Tensor | None = None,
) -> np.ndarray:
    """Per sample: repeated frames / frames whose truth moved (NaN where none moved)."""
    repeated, moved = repeated_frames(pred, truth, last_context, tau, last_decoded)
    n = moved.sum(1).double()
    rate = repeated.sum(1).double() / n.clamp(min=1)
    return torch.where(n > 0, rate, torch.nan).cpu().numpy()


@register_verifier("repetition_penalty")
def repetition_penalty(batch: Batch, tau: float = DEFAULT_TAU) -> VerifierOutput:
    """``-rate`` of repeated frames (see the module docstring); needs ``last_context_frame``.

    Metrics: ``rate`` (NaN where the truth did not move).
    """
    if LAST_CONTEXT_KEY not in set(batch.keys()):
        raise KeyError(
            f"repetition_penalty needs the tensor field {LAST_CONTEXT_KEY!r} [B, H, W, 3] "
            "(the world-model prompt processors set it)"
        )
    pred, gt = frame_pairs(batch)
    last = to_unit_float(batch[LAST_CONTEXT_KEY], LAST_CONTEXT_KEY)[:, 0].to(pred.device)
    decoded = None
    if DECODED_KEY in set(batch.keys()):
        decoded = to_unit_float(batch[DECODED_KEY], DECODED_KEY)[:, 0].to(pred.device)
    rate = repetition_rate(pred, gt, last, tau, decoded)
    return VerifierOutput(
        scores=-np.nan_to_num(rate, nan=0.0),
        valid=np.ones(len(rate), dtype=bool),
        metrics={"rate": rate},
    )
