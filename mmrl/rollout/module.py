"""Rollout on the actor's own module: the policy family samples (transformers ``generate``
for token policies, the Gaussian loop for latent policies)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmrl.models import PolicyFamily
from mmrl.protocol import Batch
from mmrl.rollout.base import register_rollout
from mmrl.sampling import SamplingParams


@register_rollout("hf")
@register_rollout("latent")
class ModuleRollout:
    """Samples with ``family.generate`` on the actor's module.

    The engine shares the actor's module, so it always samples from the current
    weights and needs no weight sync. ``rollout.name=hf`` and ``rollout.name=latent``
    both name it: what it samples is the family's business.
    """

    def __init__(
        self, model: nn.Module, family: PolicyFamily, tokenizer: Any | None = None, **_: object
    ) -> None:
        self.model, self.family, self.tokenizer = model, family, tokenizer

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Nothing to do: generation runs on the actor's own module."""

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        return self.family.generate(self.model, prompts, sampling, self.tokenizer)
