"""Policy families (text LM, VLM, latent policy, flow latent policy) and the model code they need.

:func:`policy_family` picks a checkpoint folder's family from its files; the worker,
the actor update and the rollout engines go through it.
"""

from mmrl.models import (  # noqa: F401  (registers the families)
    flow_family,
    latent_family,
    text_lm,
    vlm,
)
from mmrl.models.family import (
    FAMILIES,
    PolicyFamily,
    VLLMServing,
    get_family,
    policy_family,
    register_family,
)

__all__ = [
    "FAMILIES",
    "PolicyFamily",
    "VLLMServing",
    "get_family",
    "policy_family",
    "register_family",
]
