"""The critic's clipped value loss (GAE runs)."""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.algos.policy_losses import agg_loss
from mmrl.algos.stats import masked_mean


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    valid_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss ``0.5 * agg(max((V - R)^2, (V_clip - R)^2))``.

    vpreds: [B, T] current critic predictions. returns: [B, T] targets.
    values: [B, T] critic predictions at rollout time; ``V_clip`` stays within
    ``values +- cliprange_value``.
    response_mask: [B, T]. loss_agg_mode: see ``agg_loss``. valid_mask: [B] bool or None.
    Returns (loss scalar, {"vf_clipfrac": fraction of tokens where the clipped error won}).
    """
    vpreds_clipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpreds_clipped - returns).square()
    loss = 0.5 * agg_loss(
        torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode, valid_mask
    )
    keep = response_mask.bool()
    if valid_mask is not None:
        keep = keep & valid_mask.to(device=keep.device, dtype=torch.bool)[:, None]
    clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), keep).item()
    return loss, {"vf_clipfrac": clipfrac}
