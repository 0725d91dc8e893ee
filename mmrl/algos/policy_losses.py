"""Loss aggregation and policy-gradient losses.

Shapes: ``B`` samples, ``T`` response steps. Every policy loss is a pure function
registered under its config name and called with the same keywords::

    loss, metrics = fn(
        old_log_prob=..., log_prob=..., advantages=..., response_mask=...,
        valid_mask=..., config=...,
    )

Rows with ``valid_mask[i] == False`` contribute nothing and are not counted in
any denominator. Metrics: ``pg_clipfrac``, ``ppo_kl`` (masked mean of
``old_log_prob - log_prob``), ``pg_clipfrac_lower`` (dual-clip fraction).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algos.stats import masked_mean
from mmrl.utils.registry import Registry

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0  # |log ratio| bound before exp: e**20 ~ 4.9e8 stays finite in fp32
# GSPO's sequence ratio is capped at e**10 (verl's bound); no lower bound: exp underflows to 0.
GSPO_LOG_RATIO_MAX = 10.0

PolicyLoss = Callable[..., tuple[Tensor, dict[str, float]]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "actor_rollout_ref.actor.policy_loss")


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    valid_mask: Tensor | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar.

    loss_mat: [B, T] per-token loss.
    loss_mask: [B, T] 0/1, 1 on tokens that count.
    loss_agg_mode: one of ``AGG_MODES``:
        ``token-mean``: sum over all unmasked tokens / their number;
        ``seq-mean-token-sum``: per-row token sum, averaged over rows;
        ``seq-mean-token-mean``: per-row token mean, averaged over rows;
        ``seq-mean-token-sum-norm``: per-row token sum / ``norm_constant`` (default T),
        averaged over rows (Dr.GRPO: no length normalisation).
    valid_mask: [B] bool or None; False rows are dropped.
    Rows with no unmasked token are not counted. With nothing unmasked at all the
    result is 0, still attached to ``loss_mat``'s graph.
    """
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known: {list(AGG_MODES)}")
    keep = loss_mask.bool()
    if valid_mask is not None:
        keep = keep & valid_mask.to(device=keep.device, dtype=torch.bool)[:, None]
    masked = torch.where(keep, loss_mat, torch.zeros_like(loss_mat))
    tokens = keep.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return masked.sum() / tokens.sum().clamp(min=1)
    seq_sum = masked.sum(-1)
    seq_tokens = tokens.sum(-1)
    n_rows = (seq_tokens > 0).to(loss_mat.dtype).sum().clamp(min=1)
    if loss_agg_mode == "seq-mean-token-sum":
        seq_loss = seq_sum
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_loss = seq_sum / seq_tokens.clamp(min=1)
    else:
        seq_loss = seq_sum / (norm_constant if norm_constant is not None else loss_mat.shape[-1])
    return seq_loss.sum() / n_rows


@dataclass
class PolicyLossConfig:
    """Policy-loss settings.

    clip_ratio_low / clip_ratio_high: PPO clip range ``[1 - low, 1 + high]`` (vanilla).
    clip_ratio_c: dual-clip bound (> 1) on the loss for negative advantages; None disables.
    loss_agg_mode: aggregation for vanilla and cispo (see ``agg_loss``).
    cispo_clip_ratio_high: CISPO weight upper bound ``1 + high``.
    cispo_clip_ratio_low: CISPO weight lower bound ``1 - low``; None means no lower bound.
    gspo_clip_ratio_low / gspo_clip_ratio_high: GSPO sequence-ratio clip range.
    gspo_loss_agg_mode: aggregation for GSPO.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"
    cispo_clip_ratio_high: float = 4.0
    cispo_clip_ratio_low: float | None = None
    gspo_clip_ratio_low: float = 3e-4
    gspo_clip_ratio_high: float = 4e-4
    gspo_loss_agg_mode: str = "seq-mean-token-mean"

    def __post_init__(self) -> None:
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 or None, found {self.clip_ratio_c}")
        for key in ("loss_agg_mode", "gspo_loss_agg_mode"):
            if getattr(self, key) not in AGG_MODES:
                raise ValueError(f"{key}={getattr(self, key)!r} is not one of {list(AGG_MODES)}")


def register_policy_loss(name: str, **traits: object) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a policy loss under the config name ``name``."""
    return POLICY_LOSSES.register(name, **traits)


def get_policy_loss(name: str) -> PolicyLoss:
    """Return the policy loss registered as ``name``; ConfigError lists the known names."""
    return POLICY_LOSSES.get(name)


def _token_mask(response_mask: Tensor, valid_mask: Tensor | None) -> Tensor:
    """Bool [B, T]: response tokens of valid samples."""
    keep = response_mask.bool()
    if valid_mask is not None:
        keep = keep & valid_mask.to(device=keep.device, dtype=torch.bool)[:, None]
    return keep


def _metrics(
    clipped: Tensor, log_ratio: Tensor, mask: Tensor, clipped_lower: Tensor | None = None
) -> dict[str, float]:
    lower = 0.0 if clipped_lower is None else masked_mean(clipped_lower.float(), mask).item()
    return {
        "pg_clipfrac": masked_mean(clipped.float(), mask).item(),
        "ppo_kl": masked_mean(-log_ratio.detach(), mask).item(),
        "pg_clipfrac_lower": lower,
    }


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    valid_mask: Tensor | None = None,
    config: PolicyLossConfig | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric clip range and dual clip.

    old_log_prob: [B, T] log-probs under the behaviour policy (no grad).
    log_prob: [B, T] log-probs under the current policy.
    advantages: [B, T]. response_mask: [B, T]. valid_mask: [B] bool or None.
    config: ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``, ``loss_agg_mode``.
    loss_t = max(-A r, -A clip(r, 1 - low, 1 + high)); where A < 0 it is further
    capped at -A * clip_ratio_c.
    """
    config = config or PolicyLossConfig()
    mask = _token_mask(response_mask, valid_mask)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * clipped_ratio
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    clipped = pg_losses2 > pg_losses1
    clipped_lower = None
    if config.clip_ratio_c is not None:
        pg_losses3 = -advantages * config.clip_ratio_c
        clipped_lower = (pg_losses > pg_losses3) & (advantages < 0)
        pg_losses = torch.where(advantages < 0, torch.minimum(pg_losses, pg_losses3), pg_losses)
    loss = agg_loss(pg_losses, mask, config.loss_agg_mode)
    return loss, _metrics(clipped, log_ratio, mask, clipped_lower)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    valid_mask: Tensor | None = None,
    config: PolicyLossConfig | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO: clip a sequence-level ratio ``s_i = exp(mean_t log(pi / pi_old))``.

    old_log_prob: [B, T]. log_prob: [B, T]. advantages: [B, T]. response_mask: [B, T].
    valid_mask: [B] bool or None.
    config: ``gspo_clip_ratio_low``, ``gspo_clip_ratio_high``, ``gspo_loss_agg_mode``.
    Token form: ``s_i,t = sg(s_i) * pi_t / sg(pi_t)``, equal to ``s_i`` in value, so each
    token's gradient is its own score function scaled by the sequence ratio. ``s_i,t`` is
    capped at ``e**10`` (as in verl); above the cap the token has no gradient.
    """
    config = config or PolicyLossConfig()
    mask = _token_mask(response_mask, valid_mask)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # [B]
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    clipped_ratio = torch.clamp(
        ratio, 1 - config.gspo_clip_ratio_low, 1 + config.gspo_clip_ratio_high
    )
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * clipped_ratio
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    loss = agg_loss(pg_losses, mask, config.gspo_loss_agg_mode)
    return loss, _metrics(pg_losses2 > pg_losses1, log_ratio, mask)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    valid_mask: Tensor | None = None,
    config: PolicyLossConfig | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO: REINFORCE weighted by a clipped, detached importance ratio.

    old_log_prob: [B, T]. log_prob: [B, T]. advantages: [B, T]. response_mask: [B, T].
    valid_mask: [B] bool or None.
    config: ``cispo_clip_ratio_high``, ``cispo_clip_ratio_low`` (None: no lower bound),
    ``loss_agg_mode``.
    loss_t = -sg(clip(r_t, 1 - low, 1 + high)) * A_t * log_prob_t; every token keeps a
    gradient, the weight is what gets clipped.
    """
    config = config or PolicyLossConfig()
    mask = _token_mask(response_mask, valid_mask)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio.detach())
    low = None if config.cispo_clip_ratio_low is None else 1 - config.cispo_clip_ratio_low
    weight = torch.clamp(ratio, min=low, max=1 + config.cispo_clip_ratio_high)
    pg_losses = -weight * advantages * log_prob
    loss = agg_loss(pg_losses, mask, config.loss_agg_mode)
    return loss, _metrics(weight != ratio, log_ratio, mask)
