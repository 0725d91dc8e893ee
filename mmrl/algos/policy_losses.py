"""Loss aggregation and policy-gradient losses.

Shapes: ``B`` samples, ``T`` response steps. Every policy loss is a pure function
registered under its config name and called with the same keywords::

    loss, metrics = fn(
        old_log_prob=..., log_prob=..., advantages=..., response_mask=...,
        valid_mask=..., config=...,
    )

``config`` is the run's ``actor_rollout_ref.actor`` section (:class:`~mmrl.config.ActorConfig`)
as the YAML filled it: the clip ratios and ``loss_agg_mode`` are the actor's, and each loss's
own settings sit beside ``loss_mode`` under ``config.policy_loss``.
Rows with ``valid_mask[i] == False`` contribute nothing and are not counted in
any denominator. Metrics: ``pg_clipfrac``, ``ppo_kl`` (masked mean of
``old_log_prob - log_prob``), ``pg_clipfrac_lower`` (dual-clip fraction).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mmrl.algos.stats import masked_mean
from mmrl.config.fields import AGG_MODES
from mmrl.config.schema import ActorConfig
from mmrl.utils.registry import Registry

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


def register_policy_loss(name: str, **traits: object) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a policy loss under the config name ``name``.

    Trait ``agg_mode``: ``fn(config: ActorConfig) -> str``, the aggregation the loss uses when
    it is not ``actor.loss_agg_mode``; the actor weighs micro-batches by it.
    """
    return POLICY_LOSSES.register(name, **traits)


def pg_loss_agg_mode(config: ActorConfig) -> str:
    """The aggregation mode of the policy loss ``config.policy_loss.loss_mode`` selects."""
    own = POLICY_LOSSES.trait(config.policy_loss.loss_mode, "agg_mode")
    return own(config) if own is not None else config.loss_agg_mode


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
    config: ActorConfig | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric clip range and dual clip.

    old_log_prob: [B, T] log-probs under the behaviour policy (no grad).
    log_prob: [B, T] log-probs under the current policy.
    advantages: [B, T]. response_mask: [B, T]. valid_mask: [B] bool or None.
    config: the actor's section; reads ``clip_ratio_low``, ``clip_ratio_high``,
    ``clip_ratio_c``, ``loss_agg_mode``.
    loss_t = max(-A r, -A clip(r, 1 - low, 1 + high)); where A < 0 it is further
    capped at -A * clip_ratio_c.
    """
    config = config or ActorConfig()
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


@register_policy_loss("gspo", agg_mode=lambda config: config.policy_loss.gspo_loss_agg_mode)
def compute_policy_loss_gspo(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    valid_mask: Tensor | None = None,
    config: ActorConfig | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO: clip a sequence-level ratio ``s_i = exp(mean_t log(pi / pi_old))``.

    old_log_prob: [B, T]. log_prob: [B, T]. advantages: [B, T]. response_mask: [B, T].
    valid_mask: [B] bool or None.
    config: the actor's section; reads ``policy_loss.gspo_clip_ratio_low``,
    ``policy_loss.gspo_clip_ratio_high``, ``policy_loss.gspo_loss_agg_mode``.
    Token form: ``s_i,t = sg(s_i) * pi_t / sg(pi_t)``, equal to ``s_i`` in value, so each
    token's gradient is its own score function scaled by the sequence ratio. ``s_i,t`` is
    capped at ``e**10`` (as in verl); above the cap the token has no gradient.
    """
    config = config or ActorConfig()
    mask = _token_mask(response_mask, valid_mask)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # [B]
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    knobs = config.policy_loss
    clipped_ratio = torch.clamp(
        ratio, 1 - knobs.gspo_clip_ratio_low, 1 + knobs.gspo_clip_ratio_high
    )
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * clipped_ratio
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    loss = agg_loss(pg_losses, mask, knobs.gspo_loss_agg_mode)
    return loss, _metrics(pg_losses2 > pg_losses1, log_ratio, mask)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    valid_mask: Tensor | None = None,
    config: ActorConfig | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO: REINFORCE weighted by a clipped, detached importance ratio.

    old_log_prob: [B, T]. log_prob: [B, T]. advantages: [B, T]. response_mask: [B, T].
    valid_mask: [B] bool or None.
    config: the actor's section; reads ``policy_loss.cispo_clip_ratio_high`` (None:
    ``clip_ratio_high``), ``policy_loss.cispo_clip_ratio_low`` (None: no lower bound) and
    ``loss_agg_mode``.
    loss_t = -sg(clip(r_t, 1 - low, 1 + high)) * A_t * log_prob_t; every token keeps a
    gradient, the weight is what gets clipped.
    """
    config = config or ActorConfig()
    mask = _token_mask(response_mask, valid_mask)
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio.detach())
    knobs = config.policy_loss
    low = None if knobs.cispo_clip_ratio_low is None else 1 - knobs.cispo_clip_ratio_low
    high = (
        config.clip_ratio_high
        if knobs.cispo_clip_ratio_high is None
        else knobs.cispo_clip_ratio_high
    )
    weight = torch.clamp(ratio, min=low, max=1 + high)
    pg_losses = -weight * advantages * log_prob
    loss = agg_loss(pg_losses, mask, config.loss_agg_mode)
    return loss, _metrics(weight != ratio, log_ratio, mask)
