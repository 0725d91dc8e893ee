"""The latent world-model policy: a Gaussian head over the next frame's latent.

One policy step is one predicted latent frame: given K context latents
``[K, C, h, w]`` (from :class:`~mmrl.worldmodel.latent_ae.LatentAutoencoder`) and
the K actions up to the predicted frame, the policy outputs a diagonal Gaussian
``N(mean, exp(log_std)^2)`` over the next latent ``[C, h, w]``. Its log-density is
exact and summed over all ``C*h*w`` dimensions, so GRPO/PPO ratios apply to it as to
a token. Pretraining is maximum likelihood
(:func:`mmrl.worldmodel.latent_pretrain.pretrain_latent_policy`).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mmrl.models.row_noise import RowNoise, standard_normal
from mmrl.protocol import Batch

WEIGHTS_FILE, CONFIG_FILE = "latent_policy.safetensors", "latent_policy.json"
# The autoencoder that defines the latent space travels with the policy, as a tokenizer does with an
# LM.
AUTOENCODER_DIR = "autoencoder"


@dataclass
class LatentPolicyConfig:
    """Architecture: a small conv net; ``context`` frames and their ``context`` actions in."""

    latent_channels: int = 4
    latent_size: int = 8
    context: int = 2
    action_dim: int = 2
    hidden: int = 64
    min_log_std: float = -4.0
    max_log_std: float = 1.0


class ConvBody(nn.Sequential):
    """The hidden conv layers: the block FSDP2 shards as one unit."""


class GaussianLatentPolicy(nn.Module):
    """``p(z[K] | z[0:K], a[0:K]) = N(mean, diag(std^2))`` with ``mean`` a residual on ``z[K-1]``.

    RL hooks (used by :class:`~mmrl.models.latent_family.LatentFamily`):
    :meth:`response_log_probs` scores a rollout's latents, ``_no_split_modules`` names the
    block FSDP2 shards, and :meth:`save_pretrained` / :meth:`from_pretrained` read and
    write a folder that the worker loads (``latent_policy.json`` marks it).
    """

    _no_split_modules = ("ConvBody",)

    def __init__(self, cfg: LatentPolicyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.name_or_path: str | None = None
        c, k = cfg.latent_channels, cfg.context
        self.action_embed = nn.Linear(k * cfg.action_dim, cfg.hidden)
        self.inp = nn.Conv2d(k * c, cfg.hidden, 3, padding=1)
        self.body = ConvBody(
            nn.SiLU(), nn.Conv2d(cfg.hidden, cfg.hidden, 3, padding=1),
            nn.SiLU(), nn.Conv2d(cfg.hidden, cfg.hidden, 3, padding=1), nn.SiLU(),
        )  # fmt: skip
        self.out = nn.Conv2d(cfg.hidden, 2 * c, 3, padding=1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(
        self, context: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``context [B, K, C, h, w]``, ``actions [B, K, A]`` -> ``mean``, ``log_std`` ``[B, C, h,
        w]``.
        """
        b, k, c, h, w = context.shape
        if k != self.cfg.context or actions.shape[1:] != (k, self.cfg.action_dim):
            raise ValueError(
                f"expected context [B, {self.cfg.context}, C, h, w] and actions [B, "
                f"{self.cfg.context}, "
                f"{self.cfg.action_dim}], found {list(context.shape)} and {list(actions.shape)}"
            )
        x = (
            self.inp(context.reshape(b, k * c, h, w))
            + self.action_embed(actions.reshape(b, -1))[:, :, None, None]
        )
        delta, raw_log_std = self.out(self.body(x)).chunk(2, dim=1)
        log_std = self.cfg.min_log_std + (
            self.cfg.max_log_std - self.cfg.min_log_std
        ) * torch.sigmoid(raw_log_std)
        return context[:, -1] + delta, log_std

    def log_prob(
        self, context: torch.Tensor, actions: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        """Exact log-density of ``target [B, C, h, w]``, summed over its dims: ``[B]``."""
        mean, log_std = self(context, actions)
        return gaussian_log_prob(target, mean, log_std)

    @torch.no_grad()
    def sample(
        self,
        context: torch.Tensor,
        actions: torch.Tensor,
        greedy: bool = False,
        generator: torch.Generator | RowNoise | None = None,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A next latent ``[B, C, h, w]`` and its log-density ``[B]``.

        ``temperature`` scales the standard deviation. ``greedy`` returns the mean and the
        log-density of the untempered Gaussian there. The noise is drawn on the CPU from
        ``generator`` (one, or one per row), so a seed gives the same sample on any device.
        """
        mean, log_std = self(context, actions)
        if greedy:
            return mean, gaussian_log_prob(mean, mean, log_std)
        log_std = log_std + math.log(temperature)
        noise = standard_normal(mean.shape, generator).to(mean.device)
        z = mean + noise * log_std.exp()
        return z, gaussian_log_prob(z, mean, log_std)

    def response_log_probs(
        self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-densities ``[B, F]`` of ``batch["response_latents"]`` (and entropies ``[B, F]``).

        Teacher-forced: step ``f`` is scored given the K latents before it (context
        latents, then the batch's own earlier response latents) and ``actions[:, f:f+K]``,
        exactly as :class:`~mmrl.models.latent_family.LatentFamily` sampled it. ``temperature``
        scales the standard deviation. Entropy is the Gaussian's, summed over dims.
        """
        mean, log_std = self.step_distributions(
            batch["context_latents"], batch["actions"], batch["response_latents"]
        )
        log_std = log_std + math.log(temperature)
        z = batch["response_latents"]
        b, f = z.shape[:2]
        log_probs = gaussian_log_prob(
            z.flatten(0, 1), mean.flatten(0, 1), log_std.flatten(0, 1)
        ).view(b, f)
        entropy = None
        if with_entropy:
            entropy = (log_std + 0.5 * (1.0 + math.log(2 * math.pi))).flatten(2).sum(-1)
        return log_probs, entropy

    def step_distributions(
        self, context: torch.Tensor, actions: torch.Tensor, responses: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``mean``, ``log_std`` ``[B, F, C, h, w]`` of every response step in one forward.

        ``context [B, K, C, h, w]``, ``actions [B, K+F-1, A]``, ``responses [B, F, C, h, w]``.
        """
        k, f = context.shape[1], responses.shape[1]
        if actions.shape[1] != k + f - 1:
            raise ValueError(
                f"{f} response latents after {k} context latents need {k + f - 1} actions, "
                f"found actions {list(actions.shape)}"
            )
        seq = torch.cat([context, responses[:, :-1]], dim=1)  # [B, K+F-1, C, h, w]
        ctx = torch.stack([seq[:, i : i + k] for i in range(f)], dim=1).flatten(0, 1)
        act = torch.stack([actions[:, i : i + k] for i in range(f)], dim=1).flatten(0, 1)
        mean, log_std = self(ctx, act)
        return mean.unflatten(0, (-1, f)), log_std.unflatten(0, (-1, f))

    def save_pretrained(
        self, path: str | Path, state_dict: dict | None = None, **_: object
    ) -> None:
        """Write ``latent_policy.safetensors`` + ``latent_policy.json`` (``state_dict``: the
        gathered weights of a sharded policy) and copy the ``autoencoder/`` it was loaded with."""
        save_policy_folder(self, Path(path), state_dict, WEIGHTS_FILE, CONFIG_FILE)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> GaussianLatentPolicy:
        return load_policy_folder(cls, LatentPolicyConfig, Path(path), WEIGHTS_FILE, CONFIG_FILE)


def save_policy_folder(
    policy: nn.Module,
    path: Path,
    state_dict: dict | None,
    weights_file: str,
    config_file: str,
) -> None:
    """A latent-space policy's folder: safetensors weights, its config as JSON (``policy.cfg``)
    and the ``autoencoder/`` of the folder it was loaded from."""
    path.mkdir(parents=True, exist_ok=True)
    state = policy.state_dict() if state_dict is None else state_dict
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in state.items()}, str(path / weights_file)
    )
    (path / config_file).write_text(json.dumps(asdict(policy.cfg), indent=1))
    carry_autoencoder(policy.name_or_path, path)


def load_policy_folder(
    cls: type, config_cls: type, path: Path, weights_file: str, config_file: str
) -> Any:
    """The policy ``cls`` from a folder that :func:`save_policy_folder` wrote."""
    if not (path / config_file).is_file():
        raise FileNotFoundError(f"{path} holds no {config_file}: not a {cls.__name__} folder")
    policy = cls(config_cls(**json.loads((path / config_file).read_text())))
    policy.load_state_dict(load_file(str(path / weights_file)))
    policy.name_or_path = str(path)
    return policy


def carry_autoencoder(source: str | Path | None, dest: Path) -> None:
    """Copy ``source/autoencoder/`` (the folder a policy was loaded from) into ``dest``."""
    if not source:
        return
    folder = Path(source) / AUTOENCODER_DIR
    if folder.is_dir() and folder.resolve() != (dest / AUTOENCODER_DIR).resolve():
        shutil.copytree(folder, dest / AUTOENCODER_DIR, dirs_exist_ok=True)


def gaussian_log_prob(z: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """``sum_d log N(z_d; mean_d, exp(log_std_d)^2)`` over all dims but the first: ``[B]``."""
    per_dim = -0.5 * ((z - mean) * torch.exp(-log_std)) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
    return per_dim.flatten(1).sum(1)
