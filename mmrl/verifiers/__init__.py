"""Verifiers: scorers of decoded responses, selected from ``reward.verifiers``.

Public surface: the output type and registry (``VerifierOutput``, ``register_verifier``,
``verifier``), plugin resolution (``get_verifier``: registered names, the entry-point
group ``mmrl.verifiers``, ``module:function``, ``file.py:function``), the runner
(``VerifierRunner``, ``score_batch``), frame helpers and the closed-loop interface.
Built-ins: exact_answer, format, math_answer, psnr, ssim, mae, mse, lpips, lpips_vgg,
closed_loop, state_match. See docs/verifiers.md.
"""

from mmrl.verifiers.base import (
    VERIFIERS,
    RunOptions,
    VerifierOutput,
    VerifierOutputError,
    as_output,
    register_verifier,
    verifier,
)
from mmrl.verifiers.closed_loop import ClosedLoopSample, TaskEnvironment, register_task_score
from mmrl.verifiers.frames import aggregate_frames, frame_pairs, to_unit_float
from mmrl.verifiers.plugins import ENTRY_POINT_GROUP, available, get_verifier
from mmrl.verifiers.runner import VerifierRunner, get_runner, score_batch

__all__ = [
    "ENTRY_POINT_GROUP",
    "VERIFIERS",
    "ClosedLoopSample",
    "RunOptions",
    "TaskEnvironment",
    "VerifierOutput",
    "VerifierOutputError",
    "VerifierRunner",
    "aggregate_frames",
    "as_output",
    "available",
    "frame_pairs",
    "get_runner",
    "get_verifier",
    "register_task_score",
    "register_verifier",
    "score_batch",
    "to_unit_float",
    "verifier",
]
