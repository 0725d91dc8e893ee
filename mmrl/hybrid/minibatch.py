"""The PPO mini-batch loop that the actor and the critic updates share."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mmrl.hybrid.dispatch import metric_reduction
from mmrl.models.prompt_sharing import prompt_groups
from mmrl.protocol import Batch

# (micro-batch, its weight under each of the loss's aggregation modes) -> its metrics, each a
# value or (value, index of the mode that weighs it)
MicroStep = Callable[[Batch, tuple[float, ...]], dict[str, float | tuple[float, int]]]


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
    by_prompt: bool = False,
) -> dict[str, float]:
    """``epochs`` passes over ``batch`` in mini-batches, one optimizer step each.

    ``batch`` is this rank's share, laid out by :func:`minibatch_layout`: its i-th run of
    ``mini_batch_size`` rows is its part of the i-th global mini-batch, already shuffled.
    Later epochs regroup the rows by :func:`epoch_order`, which every rank computes alike.
    Micro-batches hold ``micro_batch_size`` rows, or, with ``max_tokens``, rows of similar
    length up to that many tokens (:func:`micro_batches`); ``by_prompt`` cuts them after
    putting the rows that share a prompt side by side. ``micro_step(micro, weights)``
    runs the forward and the backward of one micro-batch and returns its metrics.
    ``weights`` holds one weight per mode of ``loss_agg_modes`` (:func:`micro_batch_weights`):
    a loss term aggregated by a mode, times that mode's weight, accumulates into the gradient
    of the whole mini-batch's term. Gradients are clipped to ``grad_clip``; a step with a
    non-finite gradient norm is skipped, so one bad batch cannot poison the weights.

    A micro-batch's metrics are weighted as its loss is, by the first mode's weight unless
    ``micro_step`` names another (``{name: (value, mode index)}``), so a mini-batch's metric
    is the whole mini-batch's value however it is cut into micro-batches and ranks; a
    ``*_max`` one is the maximum and a ``*_min`` one the minimum (``metric_reduction``).
    Returns their mean over optimizer steps (combined over ranks by the worker group), plus
    ``<prefix>/grad_norm`` (mean over steps) and ``<prefix>/skipped_steps`` (how many steps
    were skipped).
    """
    metrics: dict[str, list[float]] = defaultdict(list)
    skipped = 0
    model.train()
    for epoch in range(epochs):
        if epoch:
            batch.reorder(epoch_order(len(batch), mini_batch_size, seed, epoch))
        for mini in batch.split(mini_batch_size):
            optimizer.zero_grad(set_to_none=True)
            micros = micro_batches(mini, micro_batch_size, max_tokens, by_prompt)
            per_mode = [micro_batch_weights(micros, mode) for mode in loss_agg_modes]
            step: dict[str, float] = defaultdict(float)
            for micro, weights in zip(micros, zip(*per_mode, strict=True), strict=True):
                for key, value in micro_step(micro, weights).items():
                    value, mode = value if isinstance(value, tuple) else (value, 0)
                    reduce = metric_reduction(key)
                    if reduce is not np.mean:  # an extreme over the micro-batches
                        step[key] = reduce([step.get(key, value), value])
                    else:
                        step[key] += value * weights[mode]
            for key, value in step.items():
                metrics[key].append(value)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
            metrics[f"{prefix}/grad_norm"].append(float(grad_norm))
    out = {k: float(metric_reduction(k)(v)) for k, v in metrics.items()}
    out[f"{prefix}/skipped_steps"] = float(skipped)
    return out


def minibatch_layout(rows: int, mini_batch_size: int, world_size: int, seed: int) -> torch.Tensor:
    """The row order in which a batch of ``rows`` goes to ``world_size`` data-parallel ranks
    for an update in global mini-batches of ``mini_batch_size`` rows.

    The rows are shuffled with ``seed`` and cut into mini-batches; each mini-batch is cut into
    one equal part per rank, and rank r's contiguous chunk (``Dispatch.DP_UPDATE``) holds its
    part of every mini-batch in turn. Every optimizer step then sees the same rows at any
    worker count, and one worker sees the order a plain shuffle gives.
    """
    mini = min(mini_batch_size, rows)
    order = np.random.default_rng(seed).permutation(rows)
    if rows % mini or mini % world_size:
        raise ValueError(
            f"{rows} rows do not split into mini-batches of {mini} with an equal part for each "
            f"of {world_size} ranks"
        )
    parts = order.reshape(rows // mini, world_size, mini // world_size)
    return torch.from_numpy(np.ascontiguousarray(parts.transpose(1, 0, 2)).reshape(-1))


def epoch_order(
    rows: int, mini_batch_size: int, seed: int, epoch: int, rank: int | None = None
) -> torch.Tensor:
    """The regrouping of a rank's laid-out rows for PPO epoch ``epoch`` (>= 1).

    Each position within a mini-batch, counted over all ranks, has its own permutation of the
    mini-batches, drawn from (``seed``, ``epoch``, that position), so rows meet other partners
    each epoch and every rank regroups its rows as one worker regroups the same rows. A batch
    whose last mini-batch is short is shuffled on this rank alone. ``rank``: the default
    process group's rank unless given.
    """
    if rank is None:
        rank = dist.get_rank() if _distributed() else 0
    mini = min(mini_batch_size, rows)
    if rows % mini:
        return torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(rows))
    grid = np.arange(rows).reshape(rows // mini, mini)
    for col in range(mini):
        moved = np.random.default_rng([seed, epoch, rank * mini + col]).permutation(len(grid))
        grid[:, col] = grid[moved, col]
    return torch.from_numpy(grid.reshape(-1))


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
    if _distributed():
        world_size = dist.get_world_size()
        summed = torch.tensor(
            [total], dtype=torch.float64, device=micros[0]["response_mask"].device
        )
        dist.all_reduce(summed)
        total = float(summed)
    return [world_size * count / max(total, 1.0) for count in counts]


def micro_batches(
    batch: Batch, micro_batch_size: int, max_tokens: int | None, by_prompt: bool = False
) -> list[Batch]:
    """``batch`` in micro-batches of ``micro_batch_size`` rows in order, or, with ``max_tokens``,
    in the groups of :func:`token_budget_groups` (verl's ``use_dynamic_bsz``). With
    ``by_prompt``, rows that share a prompt are put side by side first, so that a micro-batch
    holds whole GRPO groups and runs each prompt once (``model.share_prompts``). A mini-batch's
    gradient is the weighted sum over its micro-batches, whichever rows each holds."""
    if max_tokens is not None:
        return [batch[rows] for rows in token_budget_groups(batch, max_tokens)]
    if by_prompt and "input_ids" in batch:  # token rows; a latent policy's have no prompt ids
        steps = batch["response_mask"].shape[1]
        groups = prompt_groups(batch["input_ids"][:, :-steps], batch["attention_mask"][:, :-steps])
        batch = batch[np.concatenate(groups)]
    return batch.split(micro_batch_size)


def token_budget_groups(batch: Batch, max_tokens: int) -> list[np.ndarray]:
    """Row indices of ``batch`` sorted by length (prompt + response tokens, longest first) and
    cut into groups whose padded size, rows x (longest prompt + longest response), stays within
    ``max_tokens`` (a row longer than that alone is a group of its own).

    Each group, run without the padding no row of it uses, then costs about its real tokens
    instead of every row's full width. On several ranks, a rank with fewer groups splits its
    largest until it has as many as the rank with the most.
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
    return [np.asarray(g) for g in _as_many_as_other_ranks(groups)]


def _as_many_as_other_ranks(groups: list[list[int]]) -> list[list[int]]:
    """``groups`` with the largest split in two until there are as many as on the rank with
    the most: FSDP gathers and reduces in every forward and backward, so all ranks must run
    the same number of micro-batches (each rank holds as many rows, so a split is possible)."""
    if not _distributed() or dist.get_world_size() == 1:
        return groups
    most = torch.tensor([len(groups)])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    while len(groups) < int(most):
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        rows = groups.pop(largest)
        groups[largest:largest] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return groups


def _distributed() -> bool:
    """Whether this process has joined a default process group (a worker rank)."""
    return dist.is_available() and dist.is_initialized()
