"""A patch-local VQ model: each token is encoded from, and decodes to, one image patch only.

The convolutional ``VQModel`` sees far past its own patch (3x3 convolutions in every block),
so a code depends on the neighbouring patches too: on the grid world an agent moving one cell
changes about 18 of the frame's 64 codes, and a world model must predict all of them. Here
the encoder is a ``patch x patch`` convolution with stride ``patch`` followed by 1x1
convolutions, and the decoder mirrors it, so moving the agent changes the two patches it
leaves and enters, and everything that does not move keeps its code. diffusers'
``VectorQuantizer`` does the quantisation, and ``ModelMixin``/``ConfigMixin`` give it
``save_pretrained``/``from_pretrained`` with safetensors, as ``VQModel`` has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import VectorQuantizer
from diffusers.models.modeling_utils import ModelMixin
from torch import nn


@dataclass
class PatchLatents:
    latents: torch.Tensor


@dataclass
class PatchDecoded:
    sample: torch.Tensor


class PatchCodes:
    """``encode``/``decode`` in ``VQModel``'s shape for a model whose ``encoder`` maps a frame
    to one latent per patch, ``decoder`` maps latents back, and ``quantize`` holds the codes."""

    encoder: nn.Module
    decoder: nn.Module
    quantize: VectorQuantizer

    def encode(self, x: torch.Tensor) -> PatchLatents:
        return PatchLatents(self.encoder(x))

    def decode(self, z: torch.Tensor, force_not_quantize: bool = True) -> PatchDecoded:
        if not force_not_quantize:
            z = self.quantize(z)[0]
        return PatchDecoded(self.decoder(z))


class PatchVQModel(PatchCodes, ModelMixin, ConfigMixin):
    """Frames ``[N, 3, H, W]`` in [-1, 1] <-> one code per ``patch x patch`` block."""

    @register_to_config
    def __init__(
        self,
        patch: int = 4,
        hidden_channels: int = 128,
        vq_embed_dim: int = 16,
        num_vq_embeddings: int = 128,
        sample_size: int | list[int] = 32,
        commitment: float = 0.25,
    ) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(3, hidden_channels, patch, stride=patch),
            nn.SiLU(),
            nn.Conv2d(hidden_channels, hidden_channels, 1),
            nn.SiLU(),
            nn.Conv2d(hidden_channels, vq_embed_dim, 1),
        )
        self.quantize = VectorQuantizer(num_vq_embeddings, vq_embed_dim, beta=commitment)
        self.decoder = nn.Sequential(
            nn.Conv2d(vq_embed_dim, hidden_channels, 1),
            nn.SiLU(),
            nn.Conv2d(hidden_channels, hidden_channels, 1),
            nn.SiLU(),
            nn.ConvTranspose2d(hidden_channels, 3, patch, stride=patch),
        )
