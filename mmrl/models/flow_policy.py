"""The flow-matching latent world model: a conditional velocity net over autoencoder latents.

Given K context latents ``[K, C, h, w]`` (from
:class:`~mmrl.worldmodel.latent_ae.LatentAutoencoder`) and the K actions up to the predicted
frame, the model predicts the rectified-flow velocity ``v(x_t, t)`` of the next latent
``[C, h, w]`` (conventions in :mod:`mmrl.models.flow_sde`). It is a small diffusers
``UNet2DModel``: the noisy latent and the context latents enter as concatenated channels, the
actions as an embedding added to the time embedding. Pretraining regresses the velocity
(:func:`mmrl.worldmodel.flow_pretrain.pretrain_flow_policy`); RL treats each denoising step of
the sampler as one policy step (:mod:`mmrl.models.flow_family`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import UNet2DModel
from torch import nn

from mmrl.models.latent_policy import load_policy_folder, save_policy_folder

WEIGHTS_FILE, CONFIG_FILE = "flow_policy.safetensors", "flow_policy.json"
# The FlowPolicyConfig fields that do not change the weights: pretraining does not depend on them.
SAMPLER_KEYS = ("num_steps", "noise_level", "train_steps")
# The positional time embedding is laid out for diffusion's integer steps 0..1000.
TIME_SCALE = 1000.0


@dataclass
class FlowPolicyConfig:
    """Architecture, then the sampler that makes it a policy (read by the family only).

    ``num_steps``: denoising steps S per predicted frame (the last one is deterministic).
    ``noise_level``: the SDE's ``a`` (``sigma_t = a sqrt(t / (1 - t))``); 0 samples the ODE.
    ``train_steps``: stochastic steps per frame that RL trains on, drawn at random each rollout
    (the rest are masked out of the loss); 0 trains all ``num_steps - 1``.
    """

    latent_channels: int = 4
    latent_size: int = 8
    context: int = 2
    action_dim: int = 2
    block_out_channels: list[int] = field(default_factory=lambda: [16, 32])
    layers_per_block: int = 1
    norm_num_groups: int = 8
    num_steps: int = 8
    noise_level: float = 0.7
    train_steps: int = 0

    def __post_init__(self) -> None:
        if self.num_steps < 2:
            raise ValueError(
                f"num_steps={self.num_steps}: a flow policy needs at least 2 denoising steps "
                "(the last one is deterministic, the others are the policy's steps)"
            )
        if not 0 <= self.train_steps <= self.num_steps - 1:
            raise ValueError(
                f"train_steps={self.train_steps}: expected 0 (all) up to num_steps - 1 = "
                f"{self.num_steps - 1} stochastic steps per frame"
            )
        if self.noise_level < 0:
            raise ValueError(f"noise_level={self.noise_level}: expected >= 0")


class FlowVelocityPolicy(nn.Module):
    """``v(x_t, t | z[0:K], a[0:K])``: the velocity of the next latent frame.

    RL hooks: ``_no_split_modules`` names the blocks FSDP2 shards; every computation goes
    through :meth:`forward` (a sharded root gathers its weights there);
    :meth:`save_pretrained` / :meth:`from_pretrained` read and write a folder that
    ``flow_policy.json`` marks, with the ``autoencoder/`` it was loaded with.
    """

    _no_split_modules = ("ResnetBlock2D",)

    def __init__(self, cfg: FlowPolicyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.name_or_path: str | None = None
        c, blocks = cfg.latent_channels, tuple(cfg.block_out_channels)
        self.unet = UNet2DModel(
            sample_size=cfg.latent_size,
            in_channels=(cfg.context + 1) * c,
            out_channels=c,
            block_out_channels=blocks,
            down_block_types=("DownBlock2D",) * len(blocks),
            up_block_types=("UpBlock2D",) * len(blocks),
            layers_per_block=cfg.layers_per_block,
            norm_num_groups=cfg.norm_num_groups,
            add_attention=False,
            class_embed_type="identity",  # the action embedding joins the time embedding
        )
        self.action_embed = nn.Sequential(
            nn.Linear(cfg.context * cfg.action_dim, 4 * blocks[0]),
            nn.SiLU(),
            nn.Linear(4 * blocks[0], 4 * blocks[0]),
        )

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, actions: torch.Tensor
    ) -> torch.Tensor:
        """``x [B, C, h, w]`` at times ``t [B]``, ``context [B, K, C, h, w]``, ``actions [B, K,
        A]`` -> velocity ``[B, C, h, w]``."""
        b, k = context.shape[:2]
        if k != self.cfg.context or actions.shape[1:] != (k, self.cfg.action_dim):
            raise ValueError(
                f"expected context [B, {self.cfg.context}, C, h, w] and actions [B, "
                f"{self.cfg.context}, {self.cfg.action_dim}], found {list(context.shape)} and "
                f"{list(actions.shape)}"
            )
        inputs = torch.cat([x, context.flatten(1, 2)], dim=1)
        emb = self.action_embed(actions.reshape(b, -1).to(x.dtype))
        return self.unet(inputs, t * TIME_SCALE, class_labels=emb).sample

    def save_pretrained(
        self, path: str | Path, state_dict: dict | None = None, **_: object
    ) -> None:
        """Write ``flow_policy.safetensors`` + ``flow_policy.json`` (``state_dict``: the gathered
        weights of a sharded policy) and copy the ``autoencoder/`` it was loaded with."""
        save_policy_folder(self, Path(path), state_dict, WEIGHTS_FILE, CONFIG_FILE)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> FlowVelocityPolicy:
        return load_policy_folder(cls, FlowPolicyConfig, Path(path), WEIGHTS_FILE, CONFIG_FILE)


def flow_matching_loss(
    policy: nn.Module,
    context: torch.Tensor,
    actions: torch.Tensor,
    target: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Rectified-flow regression: ``|v(x_t, t) - (eps - target)|^2`` per dimension, with
    ``t ~ U(0, 1)`` and ``eps ~ N(0, I)`` per row; ``target [B, C, h, w]``."""
    b = target.shape[0]
    t = torch.rand(b, generator=generator).to(target)
    eps = torch.randn(target.shape, generator=generator).to(target)
    tt = t.view(-1, 1, 1, 1)
    x_t = (1 - tt) * target + tt * eps
    return torch.mean((policy(x_t, t, context, actions) - (eps - target)) ** 2)
