"""How a worker-group call is split over data-parallel ranks and how results come back.

Each worker method declares its mode with :func:`register`:

- ``ALL``: every rank gets the same arguments (init, save, load, weight sync, stats);
  the result is the list of per-rank results.
- ``DP_COMPUTE``: the first :class:`Batch` argument is cut into one chunk per rank.
  When its length does not divide, it is padded with copies of real rows
  (``Batch.pad_to_divisor``) and the padding is removed from the result. Used for
  generation and log-prob/value computation, where a padded row only costs time.
- ``DP_UPDATE``: like ``DP_COMPUTE`` but the batch must divide evenly: a padded row
  would be trained on twice.

Results of the DP modes are merged in rank order: Batches are concatenated (their
``meta`` as :func:`merge_meta` says), tensors are concatenated along dim 0, and metric
dicts (``{name: float}``) are averaged over ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import numpy as np
import torch

from mmrl.protocol import Batch

DISPATCH_ATTR = "_mmrl_dispatch"
Args = tuple[tuple[Any, ...], dict[str, Any]]


class Dispatch(Enum):
    ALL = "all"
    DP_COMPUTE = "dp_compute"
    DP_UPDATE = "dp_update"


def register(mode: Dispatch) -> Callable:
    """Mark a worker method as callable through a worker group with ``mode``."""

    def mark(fn: Callable) -> Callable:
        setattr(fn, DISPATCH_ATTR, mode)
        return fn

    return mark


def dispatch_mode(worker_cls: type, method: str) -> Dispatch:
    """The registered mode of ``worker_cls.method``; an error names the methods that exist."""
    mode = getattr(getattr(worker_cls, method, None), DISPATCH_ATTR, None)
    if mode is None:
        callable_names = sorted(
            name for name in dir(worker_cls) if hasattr(getattr(worker_cls, name), DISPATCH_ATTR)
        )
        raise AttributeError(
            f"{worker_cls.__name__}.{method} is not a worker-group method; "
            f"registered methods: {callable_names}"
        )
    return mode


def split_args(
    mode: Dispatch, world_size: int, args: Sequence[Any], kwargs: dict[str, Any], method: str
) -> tuple[list[Args], int]:
    """Per-rank ``(args, kwargs)`` for one call, and the number of padding rows added."""
    if mode is Dispatch.ALL:
        return [(tuple(args), dict(kwargs))] * world_size, 0
    position = next((i for i, a in enumerate(args) if isinstance(a, Batch)), None)
    if position is None:
        raise TypeError(f"{method} is dispatched by data-parallel rank but got no Batch argument")
    batch: Batch = args[position]
    if mode is Dispatch.DP_UPDATE and len(batch) % world_size:
        raise ValueError(
            f"{method}: a batch of {len(batch)} samples cannot be split evenly over "
            f"{world_size} data-parallel workers; make data.train_batch_size * "
            f"actor_rollout_ref.rollout.n divisible by trainer.nnodes * trainer.n_workers_per_node"
        )
    padded, pad_size = batch.pad_to_divisor(world_size)
    calls = []
    for chunk in padded.chunk(world_size):
        rank_args = list(args)
        rank_args[position] = chunk
        calls.append((tuple(rank_args), dict(kwargs)))
    return calls, pad_size


def collect(mode: Dispatch, outputs: list[Any], pad_size: int) -> Any:
    """Merge per-rank ``outputs`` (in rank order) and drop ``pad_size`` padding rows."""
    if mode is Dispatch.ALL:
        return outputs
    first = outputs[0]
    if isinstance(first, Batch):
        merged = Batch.concat(outputs).unpad(pad_size)
        merged.meta = merge_meta([b.meta for b in outputs])
        return merged
    if isinstance(first, torch.Tensor):
        merged = torch.cat(outputs)
        return merged[: len(merged) - pad_size]
    if isinstance(first, dict):
        return average_metrics(outputs)
    if first is None:
        return None
    raise TypeError(
        f"cannot merge per-rank results of type {type(first).__name__}; "
        "expected Batch, Tensor, dict of metrics or None"
    )


def merge_meta(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Batch-level values of a merged result: rank 0's, except numbers seen on every rank.

    Integers are counts (clipped responses, sampled tokens) and add up; floats are
    durations of work the ranks did in parallel, so the slowest rank's is kept.
    Padding rows are included in the counts.
    """
    merged = dict(per_rank[0])
    for key in per_rank[0]:
        values = [meta.get(key) for meta in per_rank]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            merged[key] = sum(values)
        elif all(isinstance(v, float) for v in values):
            merged[key] = max(values)
    return merged


def metric_reduction(key: str) -> Callable[[Any], Any]:
    """How a metric combines over micro-batches, optimizer steps and ranks: the maximum of a
    ``*_max`` or ``*/max`` one, the minimum of a ``*_min`` or ``*/min`` one, else the mean."""
    if key.endswith(("_max", "/max")):
        return np.max
    if key.endswith(("_min", "/min")):
        return np.min
    return np.mean


def average_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Each metric over ranks (:func:`metric_reduction`); a metric missing on some ranks
    combines the others."""
    keys = dict.fromkeys(k for metrics in per_rank for k in metrics)
    return {k: float(metric_reduction(k)([m[k] for m in per_rank if k in m])) for k in keys}
