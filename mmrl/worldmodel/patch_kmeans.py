"""A pixel-space patch tokenizer: each code is a k-means centre of the training frames' patches.

Rendered worlds and screen-like recordings are made of few distinct patches: the 64x64 push
recordings hold 1066 distinct 8x8 patches in 262144 drawn. Adam on a VQ loss leaves most codes of
a learned codebook unused there and blurs every disc into its patch (21.2 dB on held-out
frames with 128 or 512 codes, against 26.0 dB for copying the last frame), while Lloyd's
algorithm puts a code on each distinct patch (55.8 dB with 1024 codes). The encoder is
``pixel_unshuffle`` and the decoder ``pixel_shuffle``: a code is a patch's pixels, so it reads
and writes its own patch only, as :class:`~mmrl.worldmodel.patch_vq.PatchVQModel` does.
diffusers' ``VectorQuantizer`` holds the centres and assigns each patch its nearest one.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import VectorQuantizer
from diffusers.models.modeling_utils import ModelMixin
from torch import nn
from tqdm.auto import tqdm

from mmrl.worldmodel.patch_vq import PatchCodes


class PatchKMeansModel(PatchCodes, ModelMixin, ConfigMixin):
    """Frames ``[N, 3, H, W]`` in [-1, 1] <-> one code per ``patch x patch`` block, a code
    being that block's ``3 * patch**2`` pixel values."""

    @register_to_config
    def __init__(
        self,
        patch: int = 8,
        num_vq_embeddings: int = 1024,
        vq_embed_dim: int = 192,
        sample_size: int | list[int] = 64,
    ) -> None:
        super().__init__()
        if vq_embed_dim != 3 * patch * patch:
            raise ValueError(
                f"a k-means patch code holds 3*patch^2 = {3 * patch * patch} values, "
                f"found vq_embed_dim={vq_embed_dim}"
            )
        self.quantize = VectorQuantizer(num_vq_embeddings, vq_embed_dim, beta=0.25)
        self.encoder, self.decoder = nn.PixelUnshuffle(patch), nn.PixelShuffle(patch)


@torch.no_grad()
def fit_kmeans(
    model: PatchKMeansModel,
    frames: np.ndarray,
    iterations: int,
    max_patches: int,
    seed: int,
    progress: bool = True,
) -> dict[str, float]:
    """Set ``model``'s codebook to weighted k-means centres of ``frames uint8 [N, H, W, 3]``'s
    patches: at most ``max_patches`` of them drawn with ``seed``, deduplicated (a distinct
    patch weighs its count), k-means++ seeding, then Lloyd's iterations until no patch
    changes code. With fewer distinct patches than codes, the spare codes repeat the first
    centre and are never assigned. Returns the fit's summary."""
    patch, size = model.config.patch, model.config.num_vq_embeddings
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    pixels = nn.functional.pixel_unshuffle(x, patch).permute(0, 2, 3, 1).reshape(-1, 3 * patch**2)
    if len(pixels) > max_patches:
        pixels = pixels[torch.from_numpy(rng.choice(len(pixels), max_patches, replace=False))]
    distinct, counts = torch.unique(pixels, dim=0, return_counts=True)
    points, weights = distinct.float() / 127.5 - 1.0, counts.float()
    gen = torch.Generator().manual_seed(seed)
    centres = _kmeans_pp(points, weights, size, gen)
    assigned, rounds = torch.full((len(points),), -1), 0
    for _ in tqdm(range(iterations), desc="k-means patch tokenizer", disable=not progress):
        new = _nearest(points, centres)
        rounds += 1
        if torch.equal(new, assigned):
            break
        assigned = new
        mass = torch.zeros(len(centres)).index_add_(0, assigned, weights)
        sums = torch.zeros_like(centres).index_add_(0, assigned, points * weights[:, None])
        live = mass > 0
        centres[live] = sums[live] / mass[live, None]
    codebook = centres[0].repeat(size, 1)
    codebook[: len(centres)] = centres
    model.quantize.embedding.weight.copy_(codebook)
    return {
        "distinct_patches": int(len(points)),
        "patches_seen": int(len(pixels)),
        "lloyd_iterations": rounds,
    }


def _kmeans_pp(
    points: torch.Tensor, weights: torch.Tensor, k: int, gen: torch.Generator
) -> torch.Tensor:
    """Up to ``k`` seeds, each drawn with probability proportional to weight times squared
    distance to the nearest seed so far; stops early once every point is a seed."""
    first = torch.multinomial(weights, 1, generator=gen)
    chosen = [points[first[0]]]
    dist = (points - chosen[0]).square().sum(1)
    for _ in range(1, min(k, len(points))):
        mass = weights * dist
        if float(mass.sum()) <= 0:
            break
        chosen.append(points[torch.multinomial(mass, 1, generator=gen)[0]])
        dist = torch.minimum(dist, (points - chosen[-1]).square().sum(1))
    return torch.stack(chosen)


def _nearest(points: torch.Tensor, centres: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
    parts = [points[s : s + chunk] for s in range(0, len(points), chunk)]
    return torch.cat([torch.cdist(part, centres).argmin(1) for part in parts])
