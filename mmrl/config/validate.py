"""Checks of a composed :class:`RunConfig` that need nothing but the config itself.

Each field's allowed values and bounds come from its metadata (:mod:`mmrl.config.fields`);
a few checks relate fields to each other (batch sizes that must divide). Every problem is
returned, each naming its key's full path. Checks that need the registries, the task or
files on disk live in :mod:`mmrl.trainer.preflight`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

from mmrl.config.fields import bound_problem
from mmrl.config.schema import RunConfig


def walk(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """``(full key, dataclass field, value)`` for every field of dataclass ``obj``, depth first;
    lists of dataclasses are entered with ``[i]`` in the key."""
    for f in fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        yield key, f, value
        if is_dataclass(value):
            yield from walk(value, f"{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if is_dataclass(item):
                    yield from walk(item, f"{key}[{i}].")


def value_problems(cfg: Any) -> list[str]:
    """Every field whose value is not one of its choices or outside its bounds."""
    problems = []
    for key, f, value in walk(cfg):
        meta = f.metadata
        if "choices" in meta and value not in meta["choices"]:
            choices = ", ".join("null" if c is None else str(c) for c in meta["choices"])
            problems.append(f"{key}={value!r}: expected one of {choices}")
        if "item_choices" in meta:
            bad = [v for v in value if v not in meta["item_choices"]]
            if bad:
                known = ", ".join(meta["item_choices"])
                problems.append(f"{key}: unknown entries {bad}; expected any of {known}")
        problem = bound_problem(value, meta.get("bounds", {}))
        if problem:
            problems.append(f"{key}={value!r}: {problem}")
    return problems


def world_size(cfg: RunConfig) -> int:
    return cfg.trainer.n_workers_per_node * cfg.trainer.nnodes


def batch_problems(cfg: RunConfig) -> list[str]:
    """Batch sizes that would give uneven mini-batches or ranks."""
    data, actor = cfg.data, cfg.actor_rollout_ref.actor
    n, problems = cfg.actor_rollout_ref.rollout.n, []
    if min(data.train_batch_size, actor.ppo_mini_batch_size, n) < 1:
        return problems  # reported by the range checks
    # A mini-batch larger than the step's batch is the whole batch: one optimizer step.
    if actor.ppo_mini_batch_size < data.train_batch_size and (
        data.train_batch_size % actor.ppo_mini_batch_size
    ):
        problems.append(
            f"data.train_batch_size={data.train_batch_size} is not a multiple of "
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size}: the "
            "mini-batches of a step would differ in size"
        )
    ranks = world_size(cfg)
    if ranks > 1 and (actor.ppo_mini_batch_size * n) % ranks:
        problems.append(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} x "
            f"rollout.n={n} samples do not divide over {ranks} workers "
            "(trainer.n_workers_per_node x trainer.nnodes)"
        )
    return problems


def on_policy_blockers(cfg: RunConfig) -> list[str]:
    """What makes the update's own forward pass differ from recomputed old log-probs: more than
    one optimizer step per batch, or a stage that reads old_log_probs before the update."""
    data, actor, algo = cfg.data, cfg.actor_rollout_ref.actor, cfg.algorithm
    blockers = []
    if actor.ppo_epochs > 1:
        blockers.append(f"actor_rollout_ref.actor.ppo_epochs={actor.ppo_epochs}")
    if actor.ppo_mini_batch_size < data.train_batch_size:
        blockers.append(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} < "
            f"data.train_batch_size={data.train_batch_size}"
        )
    if algo.use_kl_in_reward:
        blockers.append("algorithm.use_kl_in_reward=true")
    return blockers


def old_log_prob_source(cfg: RunConfig) -> str:
    """``actor.old_log_prob`` resolved: recompute, update or rollout."""
    source = cfg.actor_rollout_ref.actor.old_log_prob
    if source == "auto":
        return "recompute" if on_policy_blockers(cfg) else "update"
    return source


def old_log_prob_problems(cfg: RunConfig) -> list[str]:
    """``actor.old_log_prob=update`` where the update is not on-policy."""
    blockers = on_policy_blockers(cfg)
    if cfg.actor_rollout_ref.actor.old_log_prob != "update" or not blockers:
        return []
    return [
        "actor_rollout_ref.actor.old_log_prob=update takes old log-probs from the update's own "
        f"forward pass, which is exact only on-policy, but {', '.join(blockers)}; use auto or "
        "recompute"
    ]


def order_problems(cfg: RunConfig) -> list[str]:
    """Pairs of bounds given the wrong way round."""
    data, problems = cfg.data, []
    pairs = [
        ("min_pixels", "max_pixels"),
        ("video_min_pixels", "video_max_pixels"),
        ("video_min_frames", "video_max_frames"),
    ]
    for low, high in pairs:
        lo, hi = getattr(data, low), getattr(data, high)
        if lo is not None and hi is not None and lo > hi:
            problems.append(f"data.{low}={lo} is larger than data.{high}={hi}")
    return problems


def field_problems(cfg: RunConfig) -> list[str]:
    """Every problem of ``cfg`` that the config alone shows."""
    return (
        value_problems(cfg) + batch_problems(cfg) + order_problems(cfg) + old_log_prob_problems(cfg)
    )
