"""The algorithm core: advantage estimators, policy losses, KL, value loss, statistics.

Every estimator and policy loss is a pure function over tensors and masks, registered
under the name that configs use. Shapes: ``B`` samples, ``T`` response steps,
``V`` vocabulary.
"""

from mmrl.algos.advantages import (
    ADV_ESTIMATORS,
    GROUP_STD_EPS,
    AdvantageEstimator,
    GroupStats,
    as_group_ids,
    discounted_returns,
    get_adv_estimator,
    group_stats,
    register_adv_estimator,
)
from mmrl.algos.kl import (
    KL_CONTROLLERS,
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
)
from mmrl.algos.policy_losses import (
    AGG_MODES,
    POLICY_LOSSES,
    PolicyLoss,
    agg_loss,
    get_policy_loss,
    pg_loss_agg_mode,
    register_policy_loss,
)
from mmrl.algos.rollout_correction import rollout_is_weights
from mmrl.algos.stats import entropy_from_logits, masked_mean, masked_var, masked_whiten
from mmrl.algos.value import compute_value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "GROUP_STD_EPS",
    "AGG_MODES",
    "KL_CONTROLLERS",
    "KL_PENALTIES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "GroupStats",
    "KLController",
    "PolicyLoss",
    "agg_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "as_group_ids",
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
    "pg_loss_agg_mode",
    "register_adv_estimator",
    "register_policy_loss",
    "rollout_is_weights",
]
