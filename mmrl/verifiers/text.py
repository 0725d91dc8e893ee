"""Text verifiers for tasks with a short, exactly checkable answer."""

from __future__ import annotations

import numpy as np

from mmrl.protocol import Batch
from mmrl.verifiers.base import VerifierOutput, register_verifier


@register_verifier("exact_answer")
def exact_answer(batch: Batch) -> VerifierOutput:
    """1.0 when the stripped response equals the stripped ground truth, else 0.0."""
    responses = batch["response_text"]
    truths = batch["ground_truth"]
    scores = np.array(
        [float(str(r).strip() == str(t).strip()) for r, t in zip(responses, truths, strict=True)]
    )
    return VerifierOutput(scores=scores, valid=np.ones(len(scores), dtype=bool))
