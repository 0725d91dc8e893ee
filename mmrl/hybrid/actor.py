"""The policy side of a PPO step: per-step log-probs and the actor update.

These functions take a plain ``nn.Module`` and its :class:`~mmrl.models.PolicyFamily`,
which scores the response steps; the worker decides how the module is wrapped
(in-process, FSDP) and where it runs.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mmrl import algos
from mmrl.config import ActorConfig
from mmrl.models import PolicyFamily
from mmrl.protocol import Batch


@torch.no_grad()
def compute_log_probs(
    family: PolicyFamily, model: nn.Module, batch: Batch, micro_batch_size: int, temperature: float
) -> torch.Tensor:
    """Log-probs [B, T] of the responses, computed in micro-batches without gradients."""
    was_training = model.training
    model.eval()
    parts = [
        family.response_log_probs(model, mb, temperature)[0] for mb in batch.split(micro_batch_size)
    ]
    model.train(was_training)
    return torch.cat(parts, dim=0)


def update_policy(
    family: PolicyFamily,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: ActorConfig,
    mini_batch_size: int,
    temperature: float,
    seed: int,
) -> dict[str, float]:
    """PPO epochs over shuffled mini-batches, accumulating gradients over micro-batches.

    ``batch`` needs ``old_log_probs``, ``advantages``, ``response_mask``, ``valid_mask``
    and, with ``cfg.use_kl_loss``, ``ref_log_prob``. Returns averaged ``actor/*`` metrics.
    """
    loss_fn = algos.get_policy_loss(cfg.policy_loss)
    loss_cfg = algos.PolicyLossConfig(
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        loss_agg_mode=cfg.loss_agg_mode,
    )
    # GSPO averages over sequences whatever loss_agg_mode says; its micro-batches are weighted
    # by that mode, or the sum would depend on how the mini-batch is split.
    pg_mode = loss_cfg.gspo_loss_agg_mode if cfg.policy_loss == "gspo" else cfg.loss_agg_mode
    rng = np.random.default_rng(seed)
    metrics: dict[str, list[float]] = defaultdict(list)
    model.train()
    for _ in range(cfg.ppo_epochs):
        batch.reorder(torch.from_numpy(rng.permutation(len(batch))))
        for mini in batch.split(mini_batch_size):
            optimizer.zero_grad(set_to_none=True)
            micros = mini.split(cfg.ppo_micro_batch_size)
            weights = zip(
                micro_batch_weights(micros, pg_mode),
                micro_batch_weights(micros, cfg.loss_agg_mode),
                strict=True,
            )
            for micro, weight in zip(micros, weights, strict=True):
                for key, value in _micro_step(
                    family, model, micro, cfg, loss_fn, loss_cfg, temperature, weight
                ).items():
                    metrics[key].append(value)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:  # one bad batch must not poison the weights
                optimizer.zero_grad(set_to_none=True)
                metrics["actor/skipped_steps"].append(1.0)
            metrics["actor/grad_norm"].append(float(grad_norm))
    metrics["actor/lr"].append(optimizer.param_groups[0]["lr"])
    return {k: float(np.mean(v)) for k, v in metrics.items()}


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


def _micro_step(
    family, model, micro, cfg, loss_fn, loss_cfg, temperature, weights
) -> dict[str, float]:
    """One micro-batch's backward; ``weights``: (policy-loss weight, weight of the other
    terms), each the micro-batch's share of the mini-batch under its aggregation."""
    mask, valid = micro["response_mask"], micro["valid_mask"]
    log_prob, entropy = family.response_log_probs(model, micro, temperature, with_entropy=True)
    advantages = micro["advantages"]
    if "rollout_is_weights" in micro:  # weights > 0, so this scales each token's clipped loss term
        advantages = advantages * micro["rollout_is_weights"]
    pg_loss, pg_metrics = loss_fn(
        old_log_prob=micro["old_log_probs"],
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        valid_mask=valid,
        config=loss_cfg,
    )
    entropy_loss = algos.agg_loss(entropy, mask, cfg.loss_agg_mode, valid_mask=valid)
    pg_weight, weight = weights
    loss = -cfg.entropy_coeff * entropy_loss
    out = {"actor/pg_loss": pg_loss.item(), "actor/entropy": entropy_loss.item()}
    if cfg.use_kl_loss:
        kl = algos.kl_penalty(log_prob, micro["ref_log_prob"], cfg.kl_loss_type)
        kl_loss = algos.agg_loss(kl, mask, cfg.loss_agg_mode, valid_mask=valid)
        loss = loss + cfg.kl_loss_coef * kl_loss
        out.update({"actor/kl_loss": kl_loss.item(), "actor/kl_coef": cfg.kl_loss_coef})
    (pg_loss * pg_weight + loss * weight).backward()
    out.update({f"actor/{k}": float(v) for k, v in pg_metrics.items()})
    return out
