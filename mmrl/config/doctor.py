"""``trainer.doctor.*``: the thresholds of the run doctor (``mmrl doctor RUN_DIR`` and its live
warnings during training). The defaults stay quiet on healthy runs of the shipped tasks."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmrl.config.fields import ranged

# The share of timing_s/step each overhead stage may take before the doctor names it.
# Generation and the actor update are the work of a step and may take any share.
DEFAULT_STAGE_SHARES = {
    "reward": 0.5,
    "old_log_prob": 0.5,
    "ref": 0.5,
    "values": 0.5,
    "adv": 0.2,
    "gen_max": 0.5,
    "update_critic": 0.7,
    "update_weights": 0.3,
}


@dataclass
class DoctorConfig:
    live: bool = True
    """Warn during training as soon as a check trips (each check once per run)."""
    max_overlong_prompt_frac: float = ranged(0.1, ge=0, le=1)
    """Prompts: the share of training prompts over data.max_prompt_length that were dropped
    (data.filter_overlong_prompts: data/filtered_prompt_frac) or cut (data.truncation:
    data/truncated_prompt_frac) above this."""
    window: int = ranged(5, ge=2)
    """Steps that a trend or an average is read over (the first and the last ``window``)."""
    reward_rise: float = ranged(0.2, gt=0)
    """Reward hacking: the training score (critic/score/mean) rose by at least this from the
    first to the last window ..."""
    val_rise_fraction: float = ranged(0.25, ge=0, le=1)
    """... while the validation score (val/score/mean, scored by reward.val_verifiers) rose by
    less than this fraction of it."""
    kl_max: float = ranged(1.0, gt=0)
    """KL spike: a step's KL (actor/kl_loss, actor/reward_kl_penalty, actor/ppo_kl) above this
    (nats per token) ..."""
    kl_spike_factor: float = ranged(10.0, gt=1)
    """... or above this many times the median of the steps before it (and above a tenth of
    kl_max)."""
    max_zero_variance_frac: float = ranged(0.6, ge=0, le=1)
    """No signal: the mean share of samples in groups whose rewards are all equal
    (actor/zero_variance_frac) over the last window above this."""
    max_length_score_corr: float = ranged(0.8, ge=-1, le=1)
    """Length bias: the mean correlation of score and response length over a step's samples
    (response_length/score_corr) over the last window above this."""
    max_logprob_diff: float = ranged(0.01, gt=0)
    """Rollout drift: the mean gap between rollout and recomputed log-probs of the sampled
    tokens (rollout/logprob_diff_mean) above this in any of the last window's steps (fp32 on
both sides: ~1e-7; a bf16 rollout beside fp32 training: 1e-3 to 6e-3)."""
    invalid_rate_rise: float = ranged(0.2, gt=0, le=1)
    """Rising invalid samples: reward/invalid_rate's last-window mean at least this above its
    first-window mean."""
    stage_shares: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_STAGE_SHARES))
    """The largest median share of timing_s/step each stage (timing_s/<stage>) may take; a
    stage not listed may take any share."""
    max_repetition: float = ranged(0.5, ge=0, le=1)
    """World models: the share of predicted frames that stand still while the truth moves
    (held-out ``repetition`` of worldmodel_eval.json, or val/repetition_penalty/rate) above
    this."""
    max_error_growth: float = ranged(2.0, gt=1)
    """World models: held-out error at the last future step above this many times the error at
    the first (MAE and LPIPS, ``mae@tF / mae@t1``): long-horizon drift."""
