"""The video tokenizer: a tiny diffusers ``VQModel`` that maps each frame to a token grid.

Frames of ``H x W`` become ``h x w`` ids in ``[0, codebook_size)`` with
``h = H / 2**(len(block_out_channels) - 1)`` (likewise ``w``; frames need not be
square). Without explicit ``block_out_channels`` the tokenizer downsamples by the
smallest power of two >= 4 that keeps ``h * w <= max_tokens_per_frame``: 32x32 frames
give 8x8 = 64 tokens (4x), 48x64 frames 6x8 = 48 (8x). It is trained here on a
trajectory dataset's frames (:func:`train_vq_tokenizer`), saved with
``save_pretrained`` and loaded by path.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import VQModel

from mmrl.worldmodel import frames as F
from mmrl.worldmodel.patch_kmeans import PatchKMeansModel, fit_kmeans
from mmrl.worldmodel.patch_vq import PatchVQModel

logger = logging.getLogger(__name__)


@dataclass
class VQConfig:
    """Architecture of the tokenizer."""

    # conv: diffusers VQModel; patch: PatchVQModel, one code per patch only; kmeans:
    # PatchKMeansModel, a code is a k-means centre of the training patches' pixels
    kind: str = "conv"
    codebook_size: int = 128
    embed_dim: int = 16
    latent_channels: int = 16
    block_out_channels: list[int] | None = None  # None: 16, 32, 32, ... chosen by frame size
    max_tokens_per_frame: int = 64  # bounds the automatic choice of block_out_channels
    layers_per_block: int = 1
    norm_num_groups: int = 8
    hidden_channels: int = 128  # patch kind only: width of its 1x1 layers
    kmeans_iterations: int = 50  # kmeans kind only: Lloyd's iterations at most
    kmeans_patches: int = 262144  # kmeans kind only: training patches drawn for the fit


def auto_channels(shape: tuple[int, int], max_tokens: int) -> list[int]:
    """``[16, 32, ...]`` with the fewest blocks (at least 3: 4x) that give at most
    ``max_tokens`` tokens per frame of ``shape``; a clear error when none divides it."""
    height, width = shape
    for blocks in range(3, 8):
        factor = 2 ** (blocks - 1)
        if height % factor or width % factor:
            break
        if (height // factor) * (width // factor) <= max_tokens:
            return [16] + [32] * (blocks - 1)
    raise ValueError(
        f"{height}x{width} frames have no downsampling by a power of two (4x or more) that "
        f"divides them and gives <= {max_tokens} tokens per frame; set data.resize or "
        "data.crop to a size divisible by 8 (e.g. 48x64), or tokenizer.model.block_out_channels"
    )


@dataclass
class AETrainConfig:
    """Training budget of a frame autoencoder (tokenizer or latent AE)."""

    steps: int = 600
    batch_size: int = 32
    lr: float = 2e-3
    seed: int = 0
    restart_every: int = 50  # VQ only: re-seed unused codes from encoder outputs
    rare_colour_weight: float = 10.0  # max loss weight of rare colours (small objects)


def build_vq_model(cfg: VQConfig, shape: int | tuple[int, int]) -> VQModel:
    """A VQ model for ``shape = (H, W)`` frames (an int: square); ``sample_size`` records it."""
    shape = (shape, shape) if isinstance(shape, int) else (int(shape[0]), int(shape[1]))
    if cfg.kind not in ("conv", "patch", "kmeans"):
        raise ValueError(f"tokenizer.model.kind must be conv, patch or kmeans, found {cfg.kind!r}")
    channels = cfg.block_out_channels or auto_channels(shape, cfg.max_tokens_per_frame)
    n = len(channels)
    factor = 2 ** (n - 1)
    sample_size = shape[0] if shape[0] == shape[1] else list(shape)
    if shape[0] % factor or shape[1] % factor:
        raise ValueError(
            f"{shape[0]}x{shape[1]} frames are not divisible by the tokenizer's {factor}x "
            "downsampling; set data.resize/data.crop or other tokenizer.model.block_out_channels"
        )
    if cfg.kind == "kmeans":
        return PatchKMeansModel(
            patch=factor,
            num_vq_embeddings=cfg.codebook_size,
            vq_embed_dim=3 * factor * factor,
            sample_size=sample_size,
        )
    if cfg.kind == "patch":
        return PatchVQModel(
            patch=factor,
            hidden_channels=cfg.hidden_channels,
            vq_embed_dim=cfg.embed_dim,
            num_vq_embeddings=cfg.codebook_size,
            sample_size=sample_size,
        )
    return VQModel(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(channels),
        layers_per_block=cfg.layers_per_block,
        latent_channels=cfg.latent_channels,
        vq_embed_dim=cfg.embed_dim,
        num_vq_embeddings=cfg.codebook_size,
        norm_num_groups=cfg.norm_num_groups,
        mid_block_add_attention=False,
        sample_size=sample_size,
    )


class VQTokenizer:
    """Frames <-> token grids with a trained ``VQModel`` (CPU, float32, no grad)."""

    def __init__(self, model: VQModel | PatchVQModel | PatchKMeansModel) -> None:
        self.model = model.eval()
        cfg = model.config
        self.codebook_size = int(cfg.num_vq_embeddings)
        size = cfg.sample_size
        self.frame_shape = (int(size), int(size)) if isinstance(size, int) else tuple(size)
        if isinstance(model, PatchVQModel | PatchKMeansModel):
            factor = int(cfg.patch)
        else:
            factor = 2 ** (len(cfg.block_out_channels) - 1)
        self.grid = (self.frame_shape[0] // factor, self.frame_shape[1] // factor)
        self.tokens_per_frame = self.grid[0] * self.grid[1]

    @classmethod
    def from_pretrained(cls, path: str | Path) -> VQTokenizer:
        config = json.loads((Path(path) / "config.json").read_text())
        patch_kinds = {k.__name__: k for k in (PatchVQModel, PatchKMeansModel)}
        kind = patch_kinds.get(config.get("_class_name"), VQModel)
        return cls(kind.from_pretrained(str(path), low_cpu_mem_usage=False))

    def save_pretrained(self, path: str | Path) -> None:
        self.model.save_pretrained(str(path))

    @torch.no_grad()
    def encode(self, frames: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """``frames uint8 [N, H, W, 3]`` -> token ids ``int64 [N, h, w]``."""
        self._check_frames(frames)
        out = [self._indices(F.to_tensor(frames[s]))[1] for s in F.batches(len(frames), batch_size)]
        return torch.cat(out).numpy() if out else np.zeros((0, *self.grid), dtype=np.int64)

    @torch.no_grad()
    def decode(self, ids: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """Token ids ``[N, h, w]`` -> ``frames uint8 [N, H, W, 3]``."""
        ids = torch.as_tensor(np.asarray(ids), dtype=torch.long)
        if ids.ndim != 3 or tuple(ids.shape[1:]) != self.grid:
            raise ValueError(
                f"expected token ids [N, {self.grid[0]}, {self.grid[1]}], found {list(ids.shape)}"
            )
        if len(ids) and (ids.min() < 0 or ids.max() >= self.codebook_size):
            raise ValueError(
                f"token ids must be in [0, {self.codebook_size}), found [{ids.min()}, {ids.max()}]"
            )
        out = []
        for s in F.batches(len(ids), batch_size):
            shape = (len(ids[s]), *self.grid, self.model.config.vq_embed_dim)
            z = self.model.quantize.get_codebook_entry(ids[s].reshape(-1), shape)
            out.append(F.to_frames(self.model.decode(z, force_not_quantize=True).sample))
        return np.concatenate(out) if out else np.zeros((0, *self.frame_shape, 3), np.uint8)

    def _indices(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-quant latents ``[N, D, h, w]``, ids ``[N, h, w]``, quantized latents, VQ loss."""
        h = self.model.encode(x).latents
        z_q, vq_loss, (_, _, idx) = self.model.quantize(h)
        return h, idx.reshape(len(x), *self.grid), z_q, vq_loss

    def _check_frames(self, frames: np.ndarray) -> None:
        want = (*self.frame_shape, 3)
        if frames.ndim != 4 or frames.shape[1:] != want or frames.dtype != np.uint8:
            raise ValueError(
                f"tokenizer expects frames uint8 [N, {want[0]}, {want[1]}, 3], "
                f"found {frames.dtype} {list(frames.shape)}"
            )


def train_vq_tokenizer(
    dataset_dir: str | Path,
    out_dir: str | Path,
    steps: int | None = None,
    cfg: VQConfig | None = None,
    train: AETrainConfig | None = None,
    progress: bool = True,
) -> VQTokenizer:
    """Train (or load from cache) a tokenizer on a trajectory dataset's frames.

    The cache in ``out_dir`` is keyed by a hash of ``cfg``, ``train`` and the
    dataset's ``index.json``; a match skips training. ``steps`` overrides
    ``train.steps``. The cache record holds reconstruction PSNR on the training
    frames next to the mean-frame baseline.
    """
    cfg, train = cfg or VQConfig(), train or AETrainConfig()
    if steps is not None:
        train = AETrainConfig(**{**asdict(train), "steps": steps})
    key = F.cache_key(dataset_dir, kind="vq", model=asdict(cfg), train=asdict(train))
    if F.cached(out_dir, key) is not None:
        logger.info("tokenizer cache hit in %s", out_dir)
        return VQTokenizer.from_pretrained(out_dir)
    frames = F.load_frames(dataset_dir)
    torch.manual_seed(train.seed)
    tok = VQTokenizer(build_vq_model(cfg, frames.shape[1:3]))
    start = time.perf_counter()
    if cfg.kind == "kmeans":
        fit = fit_kmeans(
            tok.model, frames, cfg.kmeans_iterations, cfg.kmeans_patches, train.seed, progress
        )
        losses = []
    else:
        fit, losses = {}, _fit(tok, frames, train, progress)
    tok.model.eval()
    sample = frames[np.random.default_rng(train.seed).permutation(len(frames))[:512]]
    recon = tok.decode(tok.encode(sample))
    mean_frame = np.broadcast_to(frames.mean(0).round().astype(np.uint8), sample.shape)
    record = {
        "psnr": F.psnr(recon, sample),
        "psnr_mean_frame": F.psnr(mean_frame, sample),
        "codes_used": int(len(np.unique(tok.encode(sample)))),
        **({"final_loss": float(np.mean(losses[-20:]))} if losses else {}),
        "train_time_s": time.perf_counter() - start,
        **fit,
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    F.write_cache(out_dir, key, {"model": asdict(cfg), "train": asdict(train), **record})
    logger.info("tokenizer: %s", record)
    return tok


def _fit(tok: VQTokenizer, frames: np.ndarray, train: AETrainConfig, progress: bool) -> list[float]:
    """Colour-weighted reconstruction MSE + VQ loss; unused codes re-seeded from encoder outputs."""
    model = tok.model
    usage = torch.zeros(tok.codebook_size)
    last_h: list[torch.Tensor] = []

    def loss_fn(x: torch.Tensor, batch: np.ndarray, weights: torch.Tensor) -> torch.Tensor:
        h, idx, z_q, vq_loss = tok._indices(x)
        recon = model.decode(z_q, force_not_quantize=True).sample
        usage.add_(torch.bincount(idx.reshape(-1), minlength=tok.codebook_size))
        last_h[:] = [h.detach()]
        return F.weighted_mse(recon, x, batch, weights) + vq_loss

    def restart(step: int) -> None:
        every = train.restart_every
        if every and (step + 1) % every == 0 and step + 1 < train.steps:
            _restart_dead_codes(model, usage, last_h[0])
            usage.zero_()

    return F.train_codec(model, frames, train, loss_fn, "train VQ tokenizer", progress, restart)


@torch.no_grad()
def _restart_dead_codes(
    model: VQModel | PatchVQModel, usage: torch.Tensor, h: torch.Tensor
) -> None:
    """Move codes unused since the last restart onto random encoder outputs ``h [N, D, h, w]``."""
    dead = torch.nonzero(usage == 0).reshape(-1)
    if len(dead) == 0:
        return
    vectors = h.permute(0, 2, 3, 1).reshape(-1, h.shape[1])
    pick = torch.randint(0, len(vectors), (len(dead),))
    noise = 0.01 * vectors.std() * torch.randn(len(dead), h.shape[1])
    model.quantize.embedding.weight[dead] = vectors[pick] + noise
