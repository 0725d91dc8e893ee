"""Truncated importance sampling between the rollout engine and the trainer (TIS).

A hybrid engine samples with one numeric setup (vLLM kernels, often bf16) and trains
with another (fp32). The sampling distribution ``pi_rollout`` then differs slightly
from the ``pi_old`` the PPO ratio assumes, and the policy gradient is off-policy by
that gap. Weighting each loss term by ``pi_old / pi_rollout``, capped so that a rare
token cannot blow the gradient up, corrects for it.
"""

from __future__ import annotations

import torch

LEVELS = ("token", "sequence")


def rollout_is_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Capped importance weights ``min(pi_old / pi_rollout, cap)`` [B, T] and their statistics.

    Args:
        old_log_probs: [B, T] log-probs of the sampled tokens under the trainer's actor.
        rollout_log_probs: [B, T] the same tokens' log-probs as the rollout engine sampled them.
        response_mask: [B, T] 1 on response tokens; the weight is 1 elsewhere.
        level: ``token`` (a ratio per token) or ``sequence`` (the product over the
            response's tokens, the same weight on all of them).
        cap: upper bound of a weight; no lower bound, as in TIS.
    """
    if level not in LEVELS:
        raise ValueError(f"algorithm.rollout_is={level!r}; expected one of {LEVELS} or null")
    if cap <= 0:
        raise ValueError(f"algorithm.rollout_is_cap={cap} must be positive")
    mask = response_mask.bool()
    log_ratio = torch.where(
        mask, old_log_probs - rollout_log_probs, torch.zeros_like(old_log_probs)
    )
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    # Capping in log space first keeps exp() finite for any gap.
    capped = log_ratio.clamp(max=torch.log(torch.tensor(cap, dtype=log_ratio.dtype)))
    weights = torch.where(mask, capped.exp(), torch.ones_like(capped)).detach()
    on = weights[mask]
    metrics = {}
    if on.numel():
        metrics = {
            "rollout_is/mean": float(on.mean()),
            "rollout_is/max": float(on.max()),
            "rollout_is/min": float(on.min()),
            "rollout_is/capped_frac": float((log_ratio[mask] > capped[mask]).float().mean()),
        }
    return weights, metrics
