"""The latent policy family: a Gaussian over the next frame's latent, one step per frame.

A response of F steps is sampled autoregressively: step ``f`` reads the K latents
before it (the prompt's ``context_latents`` first, then its own earlier samples) and
the K actions ``actions[:, f:f+K]`` that lead to its frame, and draws

    z_f = mean + temperature * exp(log_std) * eps,   eps ~ N(0, I)

Its log-probability is the exact log-density of that Gaussian at ``z_f``, summed over
all ``C*h*w`` dimensions, so PPO/GRPO ratios and KL penalties apply to it as to a
token's. ``do_sample=False`` returns the mean and reports the log-density of the
untempered Gaussian. ``top_k``/``top_p`` do not apply to a Gaussian and are ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmrl.models.family import PolicyFamily, register_family, torch_dtype
from mmrl.models.latent_policy import CONFIG_FILE, GaussianLatentPolicy
from mmrl.models.row_noise import RowNoise
from mmrl.protocol import Batch
from mmrl.sampling import SamplingParams


@register_family("latent")
class LatentFamily(PolicyFamily):
    """A :class:`~mmrl.models.latent_policy.GaussianLatentPolicy` folder
    (``latent_policy.json``, its weights and the ``autoencoder/`` that defines the latents).

    Prompts hold ``context_latents [B, K, C, h, w]``, ``actions [B, K+F-1, A]`` and
    ``attention_mask [B, K]`` (one position per context frame). :meth:`generate` adds
    ``response_latents [B, F, C, h, w]``, ``response_mask [B, F]`` (all ones: a latent
    response has exactly F steps), ``rollout_log_probs [B, F]``, ``response_clipped [B]``
    (all False) and extends ``attention_mask`` (and ``position_ids``) to [B, K + F].
    """

    # Its log-probs are Gaussian densities of continuous steps: bf16's 8-bit mantissa moves a
    # mean by more than the small stds resolve, so auto keeps fp32.
    auto_bf16 = False

    module_rollout = "latent"

    def detect(self, path: Path) -> bool:
        return (path / CONFIG_FILE).is_file()

    def describe(self) -> str:
        return f"a latent policy folder ({CONFIG_FILE}, its weights and autoencoder/)"

    def load(self, path: Path, dtype: str = "float32") -> nn.Module:
        return GaussianLatentPolicy.from_pretrained(path).to(torch_dtype(dtype))

    def save(
        self, model: nn.Module, path: Path, state_dict: dict[str, torch.Tensor], source: Path
    ) -> None:
        # The policy copies the autoencoder/ of the folder it was loaded from (``source``).
        model.save_pretrained(path, state_dict=state_dict)

    def response_log_probs(
        self,
        model: nn.Module,
        batch: Batch,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # A Gaussian's entropy is closed-form and cheap: it is always differentiable.
        return model.response_log_probs(batch, temperature, with_entropy)

    @torch.no_grad()
    def generate(
        self, model: nn.Module, prompts: Batch, sampling: SamplingParams, tokenizer: Any = None
    ) -> Batch:
        context, actions = prompts["context_latents"], prompts["actions"]
        k, f = context.shape[1], sampling.max_tokens
        check_latent_sampling(prompts, sampling, "a Gaussian")
        noise = RowNoise.for_rollout(prompts, sampling)
        was_training = model.training
        model.eval()
        window, latents, log_probs = context, [], []
        for step in range(f):
            z, log_prob = model.sample(
                window,
                actions[:, step : step + k],
                greedy=not sampling.do_sample,
                generator=noise,
                temperature=sampling.temperature,
            )
            latents.append(z)
            log_probs.append(log_prob)
            window = torch.cat([window[:, 1:], z.unsqueeze(1)], dim=1)
        model.train(was_training)
        return finish_latent_rollout(prompts, torch.stack(latents, 1), torch.stack(log_probs, 1))


def check_latent_sampling(prompts: Batch, sampling: SamplingParams, what: str) -> None:
    """Refuse a latent-space rollout whose prompts lack the actions its F sampled frames need,
    or whose sampling of ``what`` has no positive temperature."""
    k, f = prompts["context_latents"].shape[1], sampling.max_tokens
    actions = prompts["actions"]
    if actions.shape[1] != k + f - 1:
        raise ValueError(
            f"sampling {f} latent frames after {k} context frames needs actions "
            f"[B, {k + f - 1}, A], found {list(actions.shape)} (max_tokens comes from the "
            "processor's sampling_overrides)"
        )
    if sampling.do_sample and sampling.temperature <= 0:
        raise ValueError(f"sampling {what} needs temperature > 0, found {sampling.temperature}")


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
