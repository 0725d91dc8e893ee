"""The latent autoencoder: a tiny diffusers ``AutoencoderKL`` mapping frames to latents.

``encode`` returns the posterior mean, shifted and scaled to zero mean and unit
variance over the training frames (``shift_factor`` and ``scaling_factor`` in
the model config), so a latent policy sees standardised ``[N, C, h, w]`` latents.
Trained here (:func:`train_latent_ae`), cached like the tokenizer, loaded by path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL

from mmrl.worldmodel import frames as F
from mmrl.worldmodel.tokenizer import AETrainConfig

logger = logging.getLogger(__name__)


@dataclass
class AEConfig:
    """Architecture of the latent autoencoder; ``kl_weight`` scales the per-element KL."""

    latent_channels: int = 4
    block_out_channels: list[int] = field(default_factory=lambda: [16, 32, 32])
    layers_per_block: int = 1
    norm_num_groups: int = 8
    kl_weight: float = 1e-3


def build_ae_model(cfg: AEConfig, frame_shape: int | tuple[int, int]) -> AutoencoderKL:
    """An untrained autoencoder for ``frame_shape`` (height, width; an int: square) frames;
    each side must be a multiple of the downsampling factor,
    ``2 ** (len(block_out_channels) - 1)``."""
    if isinstance(frame_shape, int):
        frame_shape = (frame_shape, frame_shape)
    frame_shape = (int(frame_shape[0]), int(frame_shape[1]))
    n = len(cfg.block_out_channels)
    down = 2 ** (n - 1)
    if any(side % down for side in frame_shape):
        h, w = frame_shape
        raise ValueError(
            f"frames are {h}x{w}, but the latent autoencoder's {n} blocks downsample by {down}, "
            f"so each side must be a multiple of {down}: resize the frames (for videos, "
            f"task.data.resize=[{h // down * down or down},{w // down * down or down}]) or "
            "change task.autoencoder.block_out_channels"
        )
    # A square frame keeps an int sample_size, as autoencoders saved before non-square support.
    size = frame_shape[0] if frame_shape[0] == frame_shape[1] else list(frame_shape)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(cfg.block_out_channels),
        layers_per_block=cfg.layers_per_block,
        latent_channels=cfg.latent_channels,
        norm_num_groups=cfg.norm_num_groups,
        sample_size=size,
        scaling_factor=1.0,
        shift_factor=0.0,
        force_upcast=False,
        mid_block_add_attention=False,
    )


class LatentAutoencoder:
    """Frames <-> standardised latents with a trained ``AutoencoderKL`` (no grad)."""

    def __init__(self, model: AutoencoderKL) -> None:
        self.model = model.eval()
        cfg = model.config
        size = cfg.sample_size
        h, w = (size, size) if isinstance(size, int) else size
        self.frame_shape = (int(h), int(w))  # (height, width) of the frames it takes
        down = 2 ** (len(cfg.block_out_channels) - 1)
        self.latent_shape = (int(cfg.latent_channels), int(h) // down, int(w) // down)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> LatentAutoencoder:
        return cls(AutoencoderKL.from_pretrained(str(path), low_cpu_mem_usage=False))

    def save_pretrained(self, path: str | Path) -> None:
        self.model.save_pretrained(str(path))

    @torch.no_grad()
    def encode(self, frames: np.ndarray, batch_size: int = 256) -> torch.Tensor:
        """``frames uint8 [N, H, W, 3]`` -> latents ``float32 [N, C, h, w]`` (posterior mean,
        standardised).
        """
        if len(frames) and tuple(frames.shape[1:3]) != self.frame_shape:
            h, w = self.frame_shape
            raise ValueError(
                f"the latent autoencoder takes {h}x{w} frames, found "
                f"{frames.shape[1]}x{frames.shape[2]}"
            )
        cfg = self.model.config
        out = [
            self.model.encode(F.to_tensor(frames[s])).latent_dist.mean
            for s in F.batches(len(frames), batch_size)
        ]
        raw = torch.cat(out) if out else torch.zeros(0, *self.latent_shape)
        return (raw - cfg.shift_factor) * cfg.scaling_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, batch_size: int = 256) -> np.ndarray:
        """Latents ``[N, C, h, w]`` -> ``frames uint8 [N, H, W, 3]``."""
        if latents.ndim != 4 or tuple(latents.shape[1:]) != self.latent_shape:
            raise ValueError(
                f"expected latents [N, {', '.join(map(str, self.latent_shape))}], found "
                f"{list(latents.shape)}"
            )
        cfg = self.model.config
        raw = latents.float() / cfg.scaling_factor + cfg.shift_factor
        out = [
            F.to_frames(self.model.decode(raw[s]).sample) for s in F.batches(len(raw), batch_size)
        ]
        return np.concatenate(out) if out else np.zeros((0, *self.frame_shape, 3), np.uint8)


def train_latent_ae(
    dataset_dir: str | Path,
    out_dir: str | Path,
    steps: int | None = None,
    cfg: AEConfig | None = None,
    train: AETrainConfig | None = None,
    progress: bool = True,
) -> LatentAutoencoder:
    """Train (or load from cache) the latent autoencoder; see :func:`train_vq_tokenizer`."""
    cfg, train = cfg or AEConfig(), train or AETrainConfig()
    if steps is not None:
        train = AETrainConfig(**{**asdict(train), "steps": steps})
    key = F.cache_key(dataset_dir, kind="latent_ae", model=asdict(cfg), train=asdict(train))
    if F.cached(out_dir, key) is not None:
        logger.info("latent autoencoder cache hit in %s", out_dir)
        return LatentAutoencoder.from_pretrained(out_dir)
    frames = F.load_frames(dataset_dir)
    torch.manual_seed(train.seed)
    model = build_ae_model(cfg, frames.shape[1:3])
    start = time.perf_counter()
    losses = _fit(model, frames, cfg, train, progress)
    ae = LatentAutoencoder(model)
    sample = frames[np.random.default_rng(train.seed).permutation(len(frames))[:512]]
    latents = ae.encode(sample)  # shift 0, scale 1 so far: raw posterior means
    model.register_to_config(
        shift_factor=float(latents.mean()), scaling_factor=float(1 / latents.std())
    )
    recon = ae.decode(ae.encode(sample))
    mean_frame = np.broadcast_to(frames.mean(0).round().astype(np.uint8), sample.shape)
    record = {
        "psnr": F.psnr(recon, sample),
        "psnr_mean_frame": F.psnr(mean_frame, sample),
        "final_loss": float(np.mean(losses[-20:])),
        "train_time_s": time.perf_counter() - start,
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    ae.save_pretrained(out_dir)
    F.write_cache(out_dir, key, {"model": asdict(cfg), "train": asdict(train), **record})
    logger.info("latent autoencoder: %s", record)
    return ae


def _fit(
    model: AutoencoderKL, frames: np.ndarray, cfg: AEConfig, train: AETrainConfig, progress: bool
) -> list[float]:
    """Colour-weighted MSE of a posterior sample's decoding + ``kl_weight`` * per-element KL."""

    def loss_fn(x: torch.Tensor, batch: np.ndarray, weights: torch.Tensor) -> torch.Tensor:
        posterior = model.encode(x).latent_dist
        recon = model.decode(posterior.sample()).sample
        kl = posterior.kl().mean() / np.prod(posterior.mean.shape[1:])
        return F.weighted_mse(recon, x, batch, weights) + cfg.kl_weight * kl

    return F.train_codec(model, frames, train, loss_fn, "train latent autoencoder", progress)
