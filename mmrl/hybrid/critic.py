"""The value side of a PPO step, used by GAE: per-token values and the critic update."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from torch import nn

from mmrl import algos
from mmrl.config import CriticConfig
from mmrl.hybrid.actor import micro_batch_weights
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
    rng = np.random.default_rng(seed)
    metrics: dict[str, list[float]] = defaultdict(list)
    model.train()
    for _ in range(cfg.ppo_epochs):
        batch.reorder(torch.from_numpy(rng.permutation(len(batch))))
        for mini in batch.split(mini_batch_size):
            optimizer.zero_grad(set_to_none=True)
            micros = mini.split(cfg.ppo_micro_batch_size)
            for micro, weight in zip(
                micros, micro_batch_weights(micros, cfg.loss_agg_mode), strict=True
            ):
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
                (loss * weight).backward()
                metrics["critic/vf_loss"].append(loss.item())
                for k, v in loss_metrics.items():
                    metrics[f"critic/{k}"].append(float(v))
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if torch.isfinite(grad_norm):
                optimizer.step()
            metrics["critic/grad_norm"].append(float(grad_norm))
    return {k: float(np.mean(v)) for k, v in metrics.items()}
