"""The Verifier protocol, its registry, and how a verifier asks to be run.

A verifier is a function ``fn(batch: Batch, **kwargs) -> VerifierOutput | sequence of floats``
over a :class:`~mmrl.protocol.Batch` of B decoded samples. What it may read:

- ``response_text``: non-tensor [B] str, the decoded text response.
- ``pred_frames`` / ``gt_frames``: tensors [B, F, H, W, 3], channel-last RGB, either
  uint8 in [0, 255] or float in [0, 1] (see :mod:`mmrl.verifiers.frames`).
- ``ground_truth``: non-tensor [B], ``extra_info``: non-tensor [B] dicts, ``uid``: [B].

It returns one score per sample, or one per predicted frame ([B, F]: per-frame rewards,
placed on each frame's last response token), plus a per-sample valid flag and extra metrics.
An invalid sample's score is not trusted: the algorithm core leaves it out of
group statistics and of the loss (``valid_mask``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmrl.errors import VerifierError
from mmrl.utils.registry import Registry

MODES = ("batch", "process")


@dataclass
class VerifierOutput:
    """What a verifier returns for a batch of B samples.

    Attributes:
        scores: float64 [B], or [B, F] with one score per predicted frame (the trainer places
            frame t's score on that frame's last response token; needs the batch field
            ``frame_end_steps`` [B, F], which the world-model processors set).
        valid: bool [B]; False marks a sample the verifier could not score.
        metrics: extra named values, each a float or a float array [B].
        verifier_scores: the runner's combined output only: each verifier's own scores
            float64 [B] (0 where it failed; per-frame scores summed over frames), by metric
            name; validation reports them @N.
    """

    scores: np.ndarray
    valid: np.ndarray
    metrics: dict[str, np.ndarray | float] = field(default_factory=dict)
    verifier_scores: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class RunOptions:
    """How the runner calls a verifier; a config's ``VerifierSpec`` can override each field.

    Attributes:
        mode: ``"batch"`` runs one vectorised call on the whole batch in the trainer's
            process (tensor metrics on the batch's device). ``"process"`` runs calls in
            worker processes (Ray actors when Ray is initialised), in parallel and with a
            timeout: for slow, CPU-bound or hang-prone Python code.
        timeout_s: per worker call, in seconds (process mode; None: the runner's default).
        chunk_size: samples per worker call (process mode).
    """

    mode: str = "batch"
    timeout_s: float | None = None
    chunk_size: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise VerifierError(f"verifier mode {self.mode!r} is not one of {MODES}")
        if self.chunk_size < 1:
            raise VerifierError(f"verifier chunk_size must be >= 1, found {self.chunk_size}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise VerifierError(f"verifier timeout_s must be > 0 or None, found {self.timeout_s}")


class VerifierOutputError(ValueError):
    """A verifier broke its contract (wrong number of scores, wrong type): a bug, never a sample's
    fault.
    """


VerifierFn = Callable[..., "VerifierOutput | np.ndarray | Sequence[float]"]
VERIFIERS: Registry[VerifierFn] = Registry("verifier", "reward.verifiers[].name")
_OPTIONS_ATTR = "__mmrl_run_options__"


def verifier(
    mode: str = "batch", timeout_s: float | None = None, chunk_size: int = 1
) -> Callable[[VerifierFn], VerifierFn]:
    """Declare how a verifier should be run, without registering it (for plugins).

    >>> @verifier(mode="process", timeout_s=5.0)
    ... def slow_check(batch): ...
    """
    options = RunOptions(mode, timeout_s, chunk_size)

    def wrap(fn: VerifierFn) -> VerifierFn:
        setattr(fn, _OPTIONS_ATTR, options)
        return fn

    return wrap


def run_options(fn: Any) -> RunOptions:
    """The options a verifier declared with :func:`verifier`, else the defaults (batch mode)."""
    target = getattr(fn, "func", fn)  # functools.partial keeps the options of its function
    return getattr(target, _OPTIONS_ATTR, RunOptions())


def register_verifier(
    name: str, mode: str = "batch", timeout_s: float | None = None, chunk_size: int = 1
) -> Callable[[VerifierFn], VerifierFn]:
    """Register a verifier under the name that ``reward.verifiers`` uses, with its run options."""

    def wrap(fn: VerifierFn) -> VerifierFn:
        VERIFIERS.add(name, verifier(mode, timeout_s, chunk_size)(fn))
        return fn

    return wrap


def check_output(name: str, result: Any, n: int) -> tuple[VerifierOutput, np.ndarray]:
    """Normalise a verifier's return value; also return which samples had a NaN/inf score.

    Returns ``(output, nonfinite [B] bool)``. In ``output`` a non-finite score is 0 and
    its sample invalid. Raises VerifierOutputError unless there is exactly one score per sample
    (scores [B]) or one row of per-frame scores per sample ([B, F]).
    """
    if isinstance(result, VerifierOutput):
        scores, valid, metrics = result.scores, result.valid, dict(result.metrics)
    else:
        scores, valid, metrics = result, np.ones(n, dtype=bool), {}
    try:
        scores = np.asarray(_to_numpy(scores), dtype=np.float64)
        if scores.ndim != 2 or scores.shape[0] != n:  # [B, F] stays per-frame
            scores = scores.reshape(-1)
        valid = np.asarray(_to_numpy(valid), dtype=bool).reshape(-1)
    except (TypeError, ValueError) as err:
        raise VerifierOutputError(
            f"verifier {name!r} returned {type(result).__name__}, expected a VerifierOutput "
            f"or a sequence of {n} floats: {err}"
        ) from err
    if scores.shape[0] != n or valid.shape[0] != n:
        raise VerifierOutputError(
            f"verifier {name!r} returned {scores.shape[0]} scores and {valid.shape[0]} valid "
            f"flags for a batch of {n} samples; it must return exactly one per sample"
        )
    finite = np.isfinite(scores) if scores.ndim == 1 else np.isfinite(scores).all(1)
    nonfinite = valid & ~finite
    valid = valid & ~nonfinite
    out = VerifierOutput(np.where(row_mask(valid, scores), scores, 0.0), valid, metrics)
    return out, nonfinite


def as_output(name: str, result: Any, n: int) -> VerifierOutput:
    """Normalise a verifier's return value; non-finite scores mark the sample invalid."""
    return check_output(name, result, n)[0]


def row_mask(valid: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """``valid [B]`` shaped to broadcast against ``scores`` [B] or [B, F]."""
    return valid if scores.ndim == 1 else valid[:, None]


def _to_numpy(x: Any) -> Any:
    if hasattr(x, "detach"):  # a torch tensor, possibly on an accelerator
        return x.detach().float().cpu().numpy() if x.is_floating_point() else x.cpu().numpy()
    return x


__all__ = [
    "MODES",
    "VERIFIERS",
    "RunOptions",
    "VerifierFn",
    "VerifierOutput",
    "VerifierOutputError",
    "as_output",
    "check_output",
    "register_verifier",
    "row_mask",
    "run_options",
    "verifier",
]
