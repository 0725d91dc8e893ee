"""The PPO mini-batch loop that the actor and the critic updates share."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mmrl.protocol import Batch

# (micro-batch, its weight under each of the loss's aggregation modes) -> its metrics
MicroStep = Callable[[Batch, tuple[float, ...]], dict[str, float]]


def ppo_minibatches(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    micro_step: MicroStep,
    *,
    epochs: int,
    mini_batch_size: int,
    micro_batch_size: int,
    loss_agg_modes: tuple[str, ...],
    grad_clip: float,
    seed: int,
    prefix: str,
    max_tokens: int | None = None,
) -> dict[str, float]:
    """``epochs`` passes over ``batch`` in shuffled mini-batches, one optimizer step each.

    Micro-batches hold ``micro_batch_size`` rows, or, with ``max_tokens``, rows of similar
    length up to that many tokens (:func:`micro_batches`). ``micro_step(micro, weights)``
    runs the forward and the backward of one micro-batch and returns its metrics.
    ``weights`` holds one weight per mode of ``loss_agg_modes`` (:func:`micro_batch_weights`):
    a loss term aggregated by a mode, times that mode's weight, accumulates into the gradient
    of the whole mini-batch's term. Gradients are clipped to ``grad_clip``; a step with a
    non-finite gradient norm is skipped, so one bad batch cannot poison the weights. Returns
    the metrics averaged over all micro-batches (a ``*_max`` one: their maximum), plus
    ``<prefix>/grad_norm`` (mean over steps) and ``<prefix>/skipped_steps`` (how many steps
    were skipped).
    """
    rng = np.random.default_rng(seed)
    metrics: dict[str, list[float]] = defaultdict(list)
    skipped = 0
    model.train()
    for _ in range(epochs):
        batch.reorder(torch.from_numpy(rng.permutation(len(batch))))
        for mini in batch.split(mini_batch_size):
            optimizer.zero_grad(set_to_none=True)
            micros = micro_batches(mini, micro_batch_size, max_tokens)
            per_mode = [micro_batch_weights(micros, mode) for mode in loss_agg_modes]
            for micro, weights in zip(micros, zip(*per_mode, strict=True), strict=True):
                for key, value in micro_step(micro, weights).items():
                    metrics[key].append(value)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
            metrics[f"{prefix}/grad_norm"].append(float(grad_norm))
    # A maximum over micro-batches stays a maximum; everything else is their mean.
    out = {k: float(np.max(v) if k.endswith("_max") else np.mean(v)) for k, v in metrics.items()}
    out[f"{prefix}/skipped_steps"] = float(skipped)
    return out


def micro_batch_weights(micros: list[Batch], loss_agg_mode: str) -> list[float]:
    """Weights that sum micro-batch losses into one mini-batch loss, over all data-parallel ranks.

    ``agg_loss`` averages within a micro-batch: over its loss tokens (``token-mean``) or
    its rows that have any (``seq-mean-*``). Weighting each micro-batch by its share of
    that count in the whole mini-batch, summed over the ranks of the default process
    group, gives the average over the whole mini-batch however it is split into
    micro-batches and ranks. FSDP averages gradients over ranks, hence ``* world_size``.
    """
    counts = []
    for micro in micros:
        keep = micro["response_mask"].bool() & micro["valid_mask"].bool()[:, None]
        counts.append(float(keep.sum() if loss_agg_mode == "token-mean" else keep.any(-1).sum()))
    total, world_size = sum(counts), 1
    if dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
        summed = torch.tensor(
            [total], dtype=torch.float64, device=micros[0]["response_mask"].device
        )
        dist.all_reduce(summed)
        total = float(summed)
    return [world_size * count / max(total, 1.0) for count in counts]


def micro_batches(batch: Batch, micro_batch_size: int, max_tokens: int | None) -> list[Batch]:
    """``batch`` in micro-batches of ``micro_batch_size`` rows in order, or, with ``max_tokens``,
    in the groups of :func:`token_budget_groups` (verl's ``use_dynamic_bsz``)."""
    if max_tokens is None:
        return batch.split(micro_batch_size)
    return [batch[rows] for rows in token_budget_groups(batch, max_tokens)]


def token_budget_groups(batch: Batch, max_tokens: int) -> list[np.ndarray]:
    """Row indices of ``batch`` sorted by length (prompt + response tokens, longest first) and
    cut into groups whose padded size, rows x (longest prompt + longest response), stays within
    ``max_tokens`` (a row longer than that alone is a group of its own).

    Each group, run without the padding no row of it uses, then costs about its real tokens
    instead of every row's full width.
    """
    steps = batch["response_mask"].shape[1]
    prompt = batch["attention_mask"][:, :-steps].sum(-1)
    response = batch["response_mask"].sum(-1).long()
    order = torch.argsort(prompt + response, descending=True, stable=True).tolist()
    groups: list[list[int]] = []
    width = (0, 0)
    for row in order:
        grown = (max(width[0], int(prompt[row])), max(width[1], int(response[row])))
        if groups and (len(groups[-1]) + 1) * sum(grown) <= max_tokens:
            groups[-1].append(row)
            width = grown
        else:
            groups.append([row])
            width = (int(prompt[row]), int(response[row]))
    return [np.asarray(g) for g in groups]
