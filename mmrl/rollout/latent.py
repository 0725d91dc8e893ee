"""Rollout over continuous latents: a Gaussian policy samples the next frame's latent.

One **step** is one predicted latent frame ``z [C, h, w]``. A response of F steps is
sampled autoregressively: step ``f`` reads the K latents before it (the prompt's
``context_latents`` first, then its own earlier samples) and the K actions
``actions[:, f:f+K]`` that lead to its frame, and draws

    z_f = mean + temperature * exp(log_std) * eps,   eps ~ N(0, I)

Its log-probability is the exact log-density of that Gaussian at ``z_f``, summed over
all ``C*h*w`` dimensions, so PPO/GRPO ratios and KL penalties apply to it as to a
token's. ``do_sample=False`` returns the mean and reports the log-density of the
untempered Gaussian. ``top_k``/``top_p`` do not apply to a Gaussian and are ignored.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mmrl.models.latent_policy import gaussian_log_prob
from mmrl.protocol import Batch
from mmrl.rollout.base import register_rollout
from mmrl.sampling import SamplingParams


@register_rollout("latent")
class LatentRollout:
    """Samples from a module whose ``forward(context [B, K, C, h, w], actions [B, K, A])``
    returns ``(mean, log_std)`` of the next latent, e.g.
    :class:`~mmrl.models.latent_policy.GaussianLatentPolicy`.

    Prompts hold ``context_latents [B, K, C, h, w]``, ``actions [B, K+F-1, A]`` and
    ``attention_mask [B, K]`` (one position per context frame). The result adds
    ``response_latents [B, F, C, h, w]``, ``response_mask [B, F]`` (all ones: a latent
    response has exactly F steps), ``rollout_log_probs [B, F]``, ``response_clipped [B]``
    (all False) and extends ``attention_mask`` (and ``position_ids``) to [B, K + F].
    The engine shares the actor's module, so it needs no weight sync.
    """

    def __init__(self, model: nn.Module, **_: object) -> None:
        self.model = model

    def sync_weights(self, model: nn.Module) -> None:
        """Nothing to do: sampling runs on the actor's own module."""

    @torch.no_grad()
    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        context, actions = prompts["context_latents"], prompts["actions"]
        k, f = context.shape[1], sampling.max_tokens
        if actions.shape[1] != k + f - 1:
            raise ValueError(
                f"sampling {f} latent frames after {k} context frames needs actions [B, "
                f"{k + f - 1}, A], "
                f"found {list(actions.shape)} (max_tokens comes from the processor's "
                "sampling_overrides)"
            )
        if sampling.do_sample and sampling.temperature <= 0:
            raise ValueError(
                f"sampling a Gaussian needs temperature > 0, found {sampling.temperature}"
            )
        generator = torch.Generator()
        if sampling.seed is not None:
            generator.manual_seed(sampling.seed)
        else:
            generator.seed()
        was_training = self.model.training
        self.model.eval()
        window, latents, log_probs = context, [], []
        for step in range(f):
            mean, log_std = self.model(window, actions[:, step : step + k])
            if sampling.do_sample:
                log_std = log_std + math.log(sampling.temperature)
                noise = torch.randn(mean.shape, generator=generator).to(mean.device)
                z = mean + noise * log_std.exp()
            else:
                z = mean
            log_probs.append(gaussian_log_prob(z, mean, log_std))
            latents.append(z)
            window = torch.cat([window[:, 1:], z.unsqueeze(1)], dim=1)
        self.model.train(was_training)
        return finish_latent_rollout(prompts, torch.stack(latents, 1), torch.stack(log_probs, 1))


def finish_latent_rollout(prompts: Batch, latents: torch.Tensor, log_probs: torch.Tensor) -> Batch:
    """Append ``latents [B, F, C, h, w]`` and their ``log_probs [B, F]`` to ``prompts``."""
    b, f = log_probs.shape
    out = prompts.clone()
    mask = torch.ones(b, f, dtype=torch.float32, device=log_probs.device)
    out["attention_mask"] = torch.cat([prompts["attention_mask"], mask.long()], dim=1)
    if "position_ids" in prompts:
        last = prompts["position_ids"][:, -1:]
        out["position_ids"] = torch.cat(
            [prompts["position_ids"], last + torch.arange(1, f + 1, device=last.device)], 1
        )
    out["response_latents"] = latents
    out["response_mask"] = mask
    out["rollout_log_probs"] = log_probs.float()
    out["response_clipped"] = torch.zeros(b, dtype=torch.bool, device=log_probs.device)
    out.meta["num_clipped"] = 0
    return out
