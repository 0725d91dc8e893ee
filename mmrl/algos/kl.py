"""KL estimators between the policy and a reference policy, and KL coefficient control.

Shapes: ``B`` samples, ``T`` response steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from mmrl.algos.stats import masked_mean
from mmrl.config.schema import KLControlConfig
from mmrl.utils.registry import Registry


def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _abs(log_ratio: Tensor) -> Tensor:
    return log_ratio.abs()


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: Tensor) -> Tensor:
    # Schulman's unbiased, low-variance estimator with r = ref / pi: r - log r - 1 >= 0.
    ref_minus_logp = torch.clamp(-log_ratio, -20.0, 20.0)
    return torch.clamp(torch.exp(ref_minus_logp) - ref_minus_logp - 1, -10.0, 10.0)


KL_PENALTIES: Registry[Callable[[Tensor], Tensor]] = Registry("KL estimator")
for _names, _fn in ((("k1", "kl"), _k1), (("abs",), _abs), (("k2", "mse"), _k2)):
    for _name in _names:
        KL_PENALTIES.add(_name, _fn)
KL_PENALTIES.add("k3", _k3)
KL_PENALTIES.add("low_var_kl", _k3)


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate.

    log_prob: [B, T] log-probs of the sampled tokens under the policy.
    ref_log_prob: [B, T] the same under the reference policy.
    kind: ``k1``/``kl`` (logp - ref), ``abs`` (|logp - ref|), ``k2``/``mse``
    (0.5 (logp - ref)^2), ``k3``/``low_var_kl`` (exp(ref - logp) - (ref - logp) - 1,
    clamped to [-10, 10]).
    Returns [B, T].
    """
    return KL_PENALTIES.get(kind)(log_prob - ref_log_prob)


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; kept so both controllers share one interface."""


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards ``target_kl`` (Ziegler et al. 2019).

    ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, found {target_kl} and {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """current_kl: the batch's measured KL. n_steps: samples in the batch."""
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KL_CONTROLLERS: Registry[Callable[[KLControlConfig], KLController]] = Registry(
    "KL controller", "algorithm.kl_ctrl.type"
)
KL_CONTROLLERS.add("fixed", lambda cfg: FixedKLController(cfg.kl_coef))
KL_CONTROLLERS.add(
    "adaptive", lambda cfg: AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)
)


def build_kl_controller(cfg: KLControlConfig) -> KLController:
    """The controller ``algorithm.kl_ctrl.type`` names, set up from ``algorithm.kl_ctrl``."""
    return KL_CONTROLLERS.get(cfg.type)(cfg)


def apply_kl_penalty(
    token_level_scores: Tensor,
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_ctrl: KLController,
    kind: str = "kl",
    valid_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Subtract ``beta * KL`` from the rewards on every response token, then update ``kl_ctrl``.

    token_level_scores: [B, T] verifier scores (sequence score on the last valid step).
    log_prob: [B, T] policy log-probs of the sampled tokens (at rollout time).
    ref_log_prob: [B, T] reference log-probs. response_mask: [B, T].
    kl_ctrl: supplies ``beta = kl_ctrl.value`` and receives the batch KL.
    kind: see ``kl_penalty``. valid_mask: [B] bool or None; invalid rows are left out of the KL
    statistic.
    The batch KL is the mean over samples of each sample's per-token mean KL.
    Returns (token_level_rewards [B, T], metrics with ``actor/reward_kl_penalty`` and
    ``actor/reward_kl_penalty_coeff``, the beta that was applied).
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(log_prob, ref_log_prob, kind)
    kld = torch.where(mask.bool(), kld, torch.zeros_like(kld))
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    rows = mask.sum(-1) > 0
    if valid_mask is not None:
        rows = rows & valid_mask.to(device=rows.device, dtype=torch.bool)
    seq_kl = masked_mean(kld, mask, dim=-1)
    current_kl = masked_mean(seq_kl, rows).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=int(mask.shape[0]))
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
