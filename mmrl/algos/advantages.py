"""Advantage estimators and the masked statistics they share.

Shapes: ``B`` samples, ``T`` response steps. Every estimator is a pure function
registered under its config name and called with the same keywords::

    advantages [B, T], returns [B, T] = fn(
        token_level_rewards=..., response_mask=..., index=..., config=...,
        valid_mask=None, values=None, reward_baselines=None,
    )

``config`` is the run's ``algorithm`` section (:class:`~mmrl.config.AlgorithmConfig`).
Samples with ``valid_mask[i] == False`` (a verifier failed on them), and rows with
no response step, are left out of group and batch statistics and get zero
advantage and zero returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from mmrl.algos.stats import masked_whiten
from mmrl.config.schema import AlgorithmConfig
from mmrl.utils.registry import Registry

AdvantageEstimator = Callable[..., tuple[Tensor, Tensor]]
# Traits: ``needs_groups`` (compares the samples of one prompt: rollout.n must be >= 2),
# ``needs_critic`` (reads ``values``: the fit loop builds a critic), ``needs_baselines``
# (reads ``reward_baselines``: the fit loop scores one greedy response per prompt),
# ``needs_components`` (also called with ``reward_components`` [B, K] and ``reward_weights``
# [K]: each weighted verifier's own score, not only their weighted sum).
ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", "algorithm.adv_estimator"
)
GROUP_STD_EPS = 1e-6  # added to the group std before dividing (GRPO)


def register_adv_estimator(
    name: str, **traits: bool
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Register an advantage estimator under the config name ``name`` with its traits."""
    return ADV_ESTIMATORS.register(name, **traits)


def get_adv_estimator(name: str) -> AdvantageEstimator:
    """Return the estimator registered as ``name``; ConfigError lists the known names."""
    return ADV_ESTIMATORS.get(name)


# --------------------------------------------------------------------------- group statistics


def as_group_ids(
    index: np.ndarray | Sequence | Tensor, device: torch.device | None = None
) -> Tensor:
    """Turn per-sample group labels into dense group ids.

    index: [B] numpy array of uid strings (or any hashable labels), a list, or an int tensor.
    Returns LongTensor [B] with values in ``[0, n_groups)``; equal labels get equal ids.
    """
    if isinstance(index, Tensor):
        ids = torch.unique(index, return_inverse=True)[1]
    else:
        ids = torch.from_numpy(np.unique(np.asarray(index), return_inverse=True)[1].reshape(-1))
    return ids.to(device=device, dtype=torch.long)


class GroupStats(NamedTuple):
    """Statistics of each sample's group over its valid members, all [B]."""

    count: Tensor  # number of valid samples in the group
    mean: Tensor
    std: Tensor  # unbiased, like torch.std; 0 for groups with < 2 valid samples
    varies: Tensor  # bool: the valid scores in the group are not all equal


def group_stats(scores: Tensor, valid_mask: Tensor, group_ids: Tensor) -> GroupStats:
    """Group statistics with ``index_add``/``scatter_reduce``, no per-sample loop.

    scores: [B] float. valid_mask: [B] bool. group_ids: [B] long in ``[0, n_groups)``.
    """
    n_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    zeros = scores.new_zeros(n_groups)
    weight = valid_mask.to(scores.dtype)
    valid_scores = torch.where(valid_mask, scores, torch.zeros_like(scores))
    count = zeros.index_add(0, group_ids, weight)
    mean = zeros.index_add(0, group_ids, valid_scores) / count.clamp(min=1)
    dev = torch.where(valid_mask, scores - mean[group_ids], torch.zeros_like(scores))
    var = zeros.index_add(0, group_ids, dev**2) / (count - 1).clamp(min=1)
    inf = torch.full_like(scores, float("inf"))
    hi = zeros.scatter_reduce(
        0, group_ids, torch.where(valid_mask, scores, -inf), "amax", include_self=False
    )
    lo = zeros.scatter_reduce(
        0, group_ids, torch.where(valid_mask, scores, inf), "amin", include_self=False
    )
    varies = (hi > lo)[group_ids] & valid_mask
    return GroupStats(count[group_ids], mean[group_ids], var.sqrt()[group_ids], varies)


# --------------------------------------------------------------------------- shared pieces


def _prepare(token_level_rewards: Tensor, response_mask: Tensor, valid_mask: Tensor | None):
    """Return (float token mask [B, T] with invalid rows zeroed, bool valid [B]).

    A row with no response step has no score, so it counts as invalid too.
    """
    batch = token_level_rewards.shape[0]
    if valid_mask is None:
        valid = torch.ones(batch, dtype=torch.bool, device=token_level_rewards.device)
    else:
        valid = valid_mask.to(device=token_level_rewards.device, dtype=torch.bool)
        if valid.shape != (batch,):
            raise ValueError(f"valid_mask must have shape [{batch}], found {tuple(valid.shape)}")
    valid = valid & response_mask.bool().any(-1)
    mask = response_mask.to(token_level_rewards.dtype) * valid[:, None]
    return mask, valid


def _outcome_scores(token_level_rewards: Tensor, mask: Tensor) -> Tensor:
    """Sequence score [B]: the sum of token rewards over ``mask`` [B, T]."""
    return (token_level_rewards * mask).sum(-1)


def _group_normalised(scores: Tensor, valid: Tensor, groups: Tensor, by_std: bool) -> Tensor:
    """GRPO's per-sample value [B]: ``score - group mean``, divided by ``group std + eps`` when
    ``by_std``; 0 where the group's valid scores are all equal or the sample is invalid."""
    stats = group_stats(scores, valid, groups)
    centered = scores - stats.mean
    if by_std:
        centered = centered / (stats.std + GROUP_STD_EPS)
    return torch.where(stats.varies, centered, torch.zeros_like(centered))


def _require_groups(index, batch: int, device: torch.device, estimator: str) -> Tensor:
    if index is None:
        raise ValueError(f"advantage estimator {estimator!r} needs `index` (group uid per sample)")
    ids = as_group_ids(index, device)
    if ids.shape != (batch,):
        raise ValueError(f"`index` must hold {batch} group ids, found shape {tuple(ids.shape)}")
    return ids


def discounted_returns(token_level_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Return-to-go ``G_t = r_t + gamma * G_t'``, with ``t'`` the next step inside ``mask``.

    token_level_rewards: [B, T]. mask: [B, T] 0/1. Returns [B, T], 0 outside ``mask``.
    Masked steps inside a response (observation tokens of a multi-turn rollout) are
    skipped: the return passes through them undiscounted, so a final reward still
    reaches the turns before them. Rewards on masked steps are ignored.
    """
    rewards = token_level_rewards * mask
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = m * (rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    return returns


# --------------------------------------------------------------------------- estimators


@register_adv_estimator("grpo", needs_groups=True)
def compute_grpo_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | Tensor | None,
    config: AlgorithmConfig | None = None,
    valid_mask: Tensor | None = None,
    values: Tensor | None = None,
    reward_baselines: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GRPO: ``(score - group mean) / (group std + eps)``, one value per sample.

    token_level_rewards: [B, T] rewards; the sequence score is their sum over the response.
    response_mask: [B, T] 1 on valid response steps.
    index: [B] group uid per sample (numpy array of strings or int tensor).
    config: uses ``norm_adv_by_std_in_grpo`` (False: ``score - mean``, Dr.GRPO).
    valid_mask: [B] bool; invalid samples are left out of the group statistics.
    Returns (advantages [B, T], returns [B, T]), equal, broadcast over the response.
    Groups with fewer than two valid samples, or whose valid scores are all equal, get 0.
    """
    config = config or AlgorithmConfig()
    mask, valid = _prepare(token_level_rewards, response_mask, valid_mask)
    groups = _require_groups(index, mask.shape[0], mask.device, "grpo")
    scores = _outcome_scores(token_level_rewards, mask)
    adv = _group_normalised(scores, valid, groups, config.norm_adv_by_std_in_grpo)[:, None] * mask
    return adv, adv


@register_adv_estimator("gdpo", needs_groups=True, needs_components=True)
def compute_gdpo_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | Tensor | None,
    config: AlgorithmConfig | None = None,
    valid_mask: Tensor | None = None,
    values: Tensor | None = None,
    reward_baselines: Tensor | None = None,
    reward_components: Tensor | None = None,
    reward_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GDPO (Liu et al., 2026), as verl computes it: GRPO's group normalisation applied to
    each reward on its own, the results summed with the verifiers' weights, then whitened over
    the batch's response tokens.

    Summing first lets the reward with the widest spread inside a group set every advantage;
    normalising each first gives a reward on a scale of 1e-3 as much say as one of 1, in
    proportion to its weight.

    reward_components: [B, K] each weighted verifier's own per-sample score (unweighted).
    reward_weights: [K] their weights (nonzero; the sign says which way is better).
    token_level_rewards: [B, T], only for its shape and device. The other arguments are as in
    GRPO (``norm_adv_by_std_in_grpo`` false centres each reward without dividing). Returns
    (advantages [B, T], returns [B, T]), equal.
    """
    if reward_components is None or reward_weights is None:
        raise ValueError(
            "advantage estimator 'gdpo' needs `reward_components` and `reward_weights`"
        )
    config = config or AlgorithmConfig()
    mask, valid = _prepare(token_level_rewards, response_mask, valid_mask)
    groups = _require_groups(index, mask.shape[0], mask.device, "gdpo")
    components = reward_components.to(mask)
    weights = reward_weights.to(mask)
    if components.shape != (mask.shape[0], weights.numel()):
        raise ValueError(
            f"reward_components must have shape [{mask.shape[0]}, {weights.numel()}], found "
            f"{tuple(components.shape)}"
        )
    total = torch.zeros_like(valid, dtype=mask.dtype)
    norm = config.norm_adv_by_std_in_grpo
    for k in range(weights.numel()):
        total += weights[k] * _group_normalised(components[:, k], valid, groups, norm)
    adv = masked_whiten(total[:, None] * mask, mask)
    return adv, adv


@register_adv_estimator("rloo", needs_groups=True)
def compute_rloo_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | Tensor | None,
    config: AlgorithmConfig | None = None,
    valid_mask: Tensor | None = None,
    values: Tensor | None = None,
    reward_baselines: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """RLOO: score minus the mean score of the other valid samples in the group.

    token_level_rewards: [B, T]. response_mask: [B, T]. index: [B] group uid.
    valid_mask: [B] bool; invalid samples are not counted among "the others".
    Returns (advantages [B, T], returns [B, T]), equal; 0 for groups with < 2 valid samples.
    """
    mask, valid = _prepare(token_level_rewards, response_mask, valid_mask)
    groups = _require_groups(index, mask.shape[0], mask.device, "rloo")
    scores = _outcome_scores(token_level_rewards, mask)
    stats = group_stats(scores, valid, groups)
    # s - (sum - s) / (n - 1) == (s - mean) * n / (n - 1)
    loo = (scores - stats.mean) * stats.count / (stats.count - 1).clamp(min=1)
    adv = torch.where(stats.varies, loo, torch.zeros_like(loo))[:, None] * mask
    return adv, adv


@register_adv_estimator("gae", needs_critic=True)
def compute_gae_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | Tensor | None = None,
    config: AlgorithmConfig | None = None,
    valid_mask: Tensor | None = None,
    values: Tensor | None = None,
    reward_baselines: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GAE(gamma, lambda) per token, then whitened over the valid tokens of valid samples.

    token_level_rewards: [B, T]. response_mask: [B, T]. values: [B, T] critic values V(s_t).
    config: uses ``gamma`` and ``lam``. valid_mask: [B] bool.
    Masked steps are skipped: the recursion carries V and the running advantage across them.
    Returns (advantages [B, T] whitened, returns [B, T] = raw advantages + values).
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs `values` [B, T] from the critic")
    config = config or AlgorithmConfig()
    mask, _ = _prepare(token_level_rewards, response_mask, valid_mask)
    gamma, lam = config.gamma, config.lam
    next_value = values.new_zeros(values.shape[0])
    last_gae = values.new_zeros(values.shape[0])
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        m = mask[:, t]
        next_value = m * values[:, t] + (1 - m) * next_value
        last_gae = m * gae_t + (1 - m) * last_gae
        adv[:, t] = last_gae
    returns = (adv + values) * mask
    return masked_whiten(adv, mask), returns


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | Tensor | None = None,
    config: AlgorithmConfig | None = None,
    valid_mask: Tensor | None = None,
    values: Tensor | None = None,
    reward_baselines: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over the valid tokens of valid samples.

    token_level_rewards: [B, T]. response_mask: [B, T]. config: uses ``gamma``. valid_mask: [B].
    Returns (advantages [B, T] whitened, returns [B, T] return-to-go).
    """
    config = config or AlgorithmConfig()
    mask, _ = _prepare(token_level_rewards, response_mask, valid_mask)
    returns = discounted_returns(token_level_rewards, mask, config.gamma)
    return masked_whiten(returns, mask), returns


@register_adv_estimator("reinforce_plus_plus_baseline", needs_groups=True)
def compute_reinforce_plus_plus_baseline_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | Tensor | None,
    config: AlgorithmConfig | None = None,
    valid_mask: Tensor | None = None,
    values: Tensor | None = None,
    reward_baselines: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group baseline: score minus group mean, broadcast, then batch-whitened.

    token_level_rewards: [B, T]. response_mask: [B, T]. index: [B] group uid. valid_mask: [B].
    Returns (advantages [B, T], returns [B, T]), equal. A one-sample group centres to 0.
    """
    mask, valid = _prepare(token_level_rewards, response_mask, valid_mask)
    groups = _require_groups(index, mask.shape[0], mask.device, "reinforce_plus_plus_baseline")
    scores = _outcome_scores(token_level_rewards, mask)
    stats = group_stats(scores, valid, groups)
    centered = torch.where(stats.varies, scores - stats.mean, torch.zeros_like(scores))
    adv = masked_whiten(centered[:, None] * mask, mask)
    return adv, adv


@register_adv_estimator("remax", needs_baselines=True)
def compute_remax_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | Tensor | None = None,
    config: AlgorithmConfig | None = None,
    valid_mask: Tensor | None = None,
    values: Tensor | None = None,
    reward_baselines: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """ReMax: undiscounted return-to-go minus the greedy sample's score.

    token_level_rewards: [B, T]. response_mask: [B, T].
    reward_baselines: [B] score of the greedy (argmax) response to the same prompt.
    valid_mask: [B]. Returns (advantages [B, T], returns [B, T] return-to-go).
    ``gamma`` is not used: the baseline is an undiscounted sequence score, so the return
    it is subtracted from is undiscounted too (as in the ReMax paper and verl).
    """
    if reward_baselines is None:
        raise ValueError("advantage estimator 'remax' needs `reward_baselines` [B] (greedy scores)")
    mask, _ = _prepare(token_level_rewards, response_mask, valid_mask)
    if reward_baselines.shape != (mask.shape[0],):
        raise ValueError(
            f"reward_baselines must have shape [{mask.shape[0]}], found "
            f"{tuple(reward_baselines.shape)}"
        )
    returns = discounted_returns(token_level_rewards, mask, gamma=1.0)
    adv = returns - reward_baselines.to(returns)[:, None] * mask
    return adv, returns
