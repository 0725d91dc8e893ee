"""The value side of a PPO step, used by GAE: per-token values and the critic update."""

from __future__ import annotations

import torch
from torch import nn

from mmrl import algos
from mmrl.config import CriticConfig
from mmrl.hybrid.minibatch import ppo_minibatches
from mmrl.models import PolicyFamily
from mmrl.protocol import Batch


@torch.no_grad()
def compute_values(
    family: PolicyFamily, model: nn.Module, batch: Batch, micro_batch_size: int
) -> torch.Tensor:
    """Values [B, T] of the response steps (the state before each step), 0 where masked."""
    model.eval()
    values = torch.cat([family.values(model, mb) for mb in batch.split(micro_batch_size)])
    model.train()
    return values * batch["response_mask"]


def update_critic(
    family: PolicyFamily,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: CriticConfig,
    mini_batch_size: int,
    seed: int,
) -> dict[str, float]:
    """Clipped value regression towards ``returns``; returns averaged ``critic/*`` metrics."""

    def micro_step(micro: Batch, weights: tuple[float, ...]) -> dict[str, float]:
        vpreds = family.values(model, micro)
        loss, loss_metrics = algos.compute_value_loss(
            vpreds=vpreds,
            returns=micro["returns"],
            values=micro["values"],
            response_mask=micro["response_mask"],
            cliprange_value=cfg.cliprange_value,
            loss_agg_mode=cfg.loss_agg_mode,
            valid_mask=micro["valid_mask"],
        )
        (loss * weights[0]).backward()
        return {
            "critic/vf_loss": loss.item(),
            **{f"critic/{k}": float(v) for k, v in loss_metrics.items()},
        }

    return ppo_minibatches(
        model,
        optimizer,
        batch,
        micro_step,
        epochs=cfg.ppo_epochs,
        mini_batch_size=mini_batch_size,
        micro_batch_size=cfg.ppo_micro_batch_size,
        loss_agg_modes=(cfg.loss_agg_mode,),
        grad_clip=cfg.grad_clip,
        seed=seed,
        prefix="critic",
    )
