"""Algorithm core: advantage estimators, policy losses, KL, value loss and entropy.

The estimators live in ``advantages``, the policy losses and ``agg_loss`` in
``policy_losses`` and the KL pieces in ``kl``; this module re-exports them, so
``from mmrl.trainer.core_algos import get_adv_estimator`` is the one import a
trainer needs. Shapes: ``B`` samples, ``T`` response steps, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmrl.trainer.advantages import (
    ADV_ESTIMATORS,
    AdvantageConfig,
    AdvantageEstimator,
    GroupStats,
    as_group_ids,
    compute_gae_advantage,
    compute_grpo_advantage,
    compute_reinforce_plus_plus_advantage,
    compute_reinforce_plus_plus_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    discounted_returns,
    get_adv_estimator,
    group_stats,
    masked_mean,
    masked_var,
    masked_whiten,
    register_adv_estimator,
)
from mmrl.trainer.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    kl_penalty,
)
from mmrl.trainer.policy_losses import (
    AGG_MODES,
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossConfig,
    agg_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    get_policy_loss,
    register_policy_loss,
)
from mmrl.trainer.rollout_correction import rollout_is_weights

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "KL_PENALTIES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageConfig",
    "AdvantageEstimator",
    "FixedKLController",
    "GroupStats",
    "KLController",
    "PolicyLoss",
    "PolicyLossConfig",
    "agg_loss",
    "apply_kl_penalty",
    "as_group_ids",
    "compute_gae_advantage",
    "compute_grpo_advantage",
    "compute_policy_loss_cispo",
    "compute_policy_loss_gspo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_advantage",
    "compute_rloo_advantage",
    "compute_value_loss",
    "discounted_returns",
    "entropy_from_logits",
    "get_adv_estimator",
    "get_policy_loss",
    "group_stats",
    "kl_penalty",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "register_adv_estimator",
    "register_policy_loss",
    "rollout_is_weights",
]


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)``: ``logsumexp(z) - sum_v p_v z_v``.

    logits: [..., V] finite logits. Returns [...].
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


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
