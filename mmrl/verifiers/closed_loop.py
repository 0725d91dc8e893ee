"""Closed-loop task scores: judge a predicted future by acting in an environment.

A world model predicts F future frames for an action context. A closed-loop task
score hands that prediction, together with a handle to the environment the sample
came from, to a task-specific function: for example, plan with the predicted
frames and measure whether the environment reaches the goal, or roll the true
environment forward and compare states. The concrete task scores live beside
their environments; this module defines the interface and the verifier that
drives it.

Per sample the verifier needs an environment handle, taken from (first found):

- the non-tensor field ``env`` [B]: a handle per sample, already at its start state;
- ``batch.meta["env_factory"]``: ``factory(extra_info) -> handle``.

Register a task score with :func:`register_task_score` and select it with
``{name: closed_loop, kwargs: {task: <name>}}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from torch import Tensor

from mmrl.protocol import Batch
from mmrl.utils.registry import Registry
from mmrl.verifiers.base import VerifierOutput, register_verifier
from mmrl.verifiers.frames import PRED_KEY, to_unit_float


class TaskEnvironment(Protocol):
    """What a closed-loop score may use of an environment (implementations may offer more)."""

    def reset(self, seed: int | None = None) -> Any: ...

    def step(self, action: Any) -> Any: ...


@dataclass
class ClosedLoopSample:
    """One sample handed to a task score.

    Attributes:
        env: the environment handle, at the sample's start state.
        predicted_frames: float32 [F, H, W, 3] in [0, 1], the predicted future.
        actions: the action context [F, A] (tensor field ``actions``), or None.
        ground_truth: the sample's ``ground_truth`` value, or None.
        extra_info: the sample's ``extra_info`` dict.
    """

    env: Any
    predicted_frames: Tensor
    actions: Tensor | None = None
    ground_truth: Any = None
    extra_info: dict = field(default_factory=dict)


TaskScore = Callable[[ClosedLoopSample], float]
TASK_SCORES: Registry[TaskScore] = Registry("closed-loop task score", "closed_loop kwargs.task")


def register_task_score(name: str) -> Callable[[TaskScore], TaskScore]:
    """Register ``fn(sample: ClosedLoopSample) -> float`` under ``name``; higher is better."""

    return TASK_SCORES.register(name)


def environment_handles(batch: Batch) -> list[Any]:
    """One environment handle per sample; see the module docstring for where they come from."""
    n = len(batch)
    if "env" in batch.non_tensor:
        return list(batch.non_tensor["env"])
    factory = batch.meta.get("env_factory")
    if factory is None:
        raise KeyError(
            "closed-loop verifiers need environment handles: a non-tensor field 'env' [B] "
            "or batch.meta['env_factory'] (extra_info -> handle); found neither"
        )
    infos = batch.non_tensor.get("extra_info", np.full(n, None, dtype=object))
    return [factory(info or {}) for info in infos]


@register_verifier("closed_loop")
def closed_loop(batch: Batch, task: str) -> VerifierOutput:
    """Score each sample's ``pred_frames`` with the registered task score ``task``.

    Samples are scored one by one (environments are stateful); a score that raises
    makes the runner find and mark that sample invalid.
    """
    score = TASK_SCORES.get(task)
    frames = to_unit_float(batch[PRED_KEY], PRED_KEY)
    actions = batch["actions"] if "actions" in set(batch.keys()) else None
    truths = batch.non_tensor.get("ground_truth")
    infos = batch.non_tensor.get("extra_info")
    scores = [
        float(
            score(
                ClosedLoopSample(
                    env=env,
                    predicted_frames=frames[i],
                    actions=None if actions is None else actions[i],
                    ground_truth=None if truths is None else truths[i],
                    extra_info=dict(infos[i] or {}) if infos is not None else {},
                )
            )
        )
        for i, env in enumerate(environment_handles(batch))
    ]
    return VerifierOutput(scores=np.array(scores), valid=np.ones(len(batch), dtype=bool))
