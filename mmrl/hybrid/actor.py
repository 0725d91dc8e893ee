"""The policy side of a PPO step: per-step log-probs and the actor update.

These functions take a plain ``nn.Module`` and its :class:`~mmrl.models.PolicyFamily`,
which scores the response steps; the worker decides how the module is wrapped
(in-process, FSDP) and where it runs.
"""

from __future__ import annotations

import torch
from torch import nn

from mmrl import algos
from mmrl.config import ActorConfig
from mmrl.hybrid.minibatch import ppo_minibatches
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
    loss_fn = algos.get_policy_loss(cfg.policy_loss.loss_mode)
    # A loss may aggregate otherwise than loss_agg_mode (GSPO: gspo_loss_agg_mode); its
    # micro-batches are weighted by its own mode, or the sum would depend on the split.
    pg_mode = algos.pg_loss_agg_mode(cfg)
    metrics = ppo_minibatches(
        model,
        optimizer,
        batch,
        lambda micro, weights: _micro_step(
            family, model, micro, cfg, loss_fn, temperature, weights
        ),
        epochs=cfg.ppo_epochs,
        mini_batch_size=mini_batch_size,
        micro_batch_size=cfg.ppo_micro_batch_size,
        loss_agg_modes=(pg_mode, cfg.loss_agg_mode),
        grad_clip=cfg.grad_clip,
        seed=seed,
        prefix="actor",
    )
    metrics["actor/lr"] = optimizer.param_groups[0]["lr"]
    return metrics


def _micro_step(family, model, micro, cfg, loss_fn, temperature, weights) -> dict[str, float]:
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
        config=cfg,
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
