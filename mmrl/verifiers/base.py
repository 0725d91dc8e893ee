"""The Verifier protocol and its registry.

A verifier takes a :class:`~mmrl.protocol.Batch` of decoded responses (for text,
the non-tensor field ``response_text``; other modalities add decoded frames)
together with ``ground_truth`` and ``extra_info``, and returns one score per
sample plus a per-sample valid flag. An invalid sample's score is not trusted:
the algorithm core leaves it out of group statistics and of the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mmrl.protocol import Batch


@dataclass
class VerifierOutput:
    """What a verifier returns for a batch of B samples.

    Attributes:
        scores: float64 [B].
        valid: bool [B]; False marks a sample the verifier could not score.
        metrics: extra named values, each a float or a float array [B].
    """

    scores: np.ndarray
    valid: np.ndarray
    metrics: dict[str, np.ndarray | float] = field(default_factory=dict)


VerifierFn = Callable[[Batch], "VerifierOutput | np.ndarray | list[float]"]
VERIFIERS: dict[str, VerifierFn] = {}


def register_verifier(name: str) -> Callable[[VerifierFn], VerifierFn]:
    """Register a verifier under the name that ``reward.verifiers`` uses."""

    def wrap(fn: VerifierFn) -> VerifierFn:
        if name in VERIFIERS:
            raise ValueError(f"verifier {name!r} is already registered")
        VERIFIERS[name] = fn
        return fn

    return wrap


def get_verifier(name: str) -> VerifierFn:
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; registered: {sorted(VERIFIERS)}")
    return VERIFIERS[name]


def as_output(name: str, result: VerifierOutput | np.ndarray | list[float], n: int) -> VerifierOutput:
    """Normalise a verifier's return value and check it holds one score per sample.

    A plain sequence of scores is accepted; non-finite scores mark the sample invalid.
    """
    if not isinstance(result, VerifierOutput):
        result = VerifierOutput(scores=np.asarray(result, dtype=np.float64), valid=np.ones(n, bool))
    scores = np.asarray(result.scores, dtype=np.float64).reshape(-1)
    valid = np.asarray(result.valid, dtype=bool).reshape(-1)
    if scores.shape[0] != n or valid.shape[0] != n:
        raise ValueError(
            f"verifier {name!r} returned {scores.shape[0]} scores and {valid.shape[0]} valid "
            f"flags for a batch of {n} samples; it must return exactly one per sample"
        )
    valid = valid & np.isfinite(scores)
    scores = np.where(valid, scores, 0.0)
    return VerifierOutput(scores=scores, valid=valid, metrics=dict(result.metrics))


def score_batch(batch: Batch, verifiers: list[tuple[str, float]]) -> VerifierOutput:
    """Run each named verifier and combine them as a weighted sum.

    A sample is valid only if every verifier scored it. Per-verifier scores are
    reported as ``reward/<name>/mean`` metrics.
    """
    n = len(batch)
    total = np.zeros(n)
    valid = np.ones(n, dtype=bool)
    metrics: dict[str, np.ndarray | float] = {}
    for name, weight in verifiers:
        out = as_output(name, get_verifier(name)(batch), n)
        total += weight * out.scores
        valid &= out.valid
        metrics[f"reward/{name}/mean"] = float(out.scores[out.valid].mean()) if out.valid.any() else 0.0
        for key, value in out.metrics.items():
            metrics[f"reward/{name}/{key}"] = value
    metrics["reward/invalid_rate"] = float(1.0 - valid.mean()) if n else 0.0
    return VerifierOutput(scores=np.where(valid, total, 0.0), valid=valid, metrics=metrics)
