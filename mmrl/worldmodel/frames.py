"""Helpers shared by the frame autoencoders (VQ tokenizer, latent AE): pixel conversion, PSNR,
training frames, caching, and the one training loop both use."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from mmrl.worldmodel.data import INDEX_FILE, TrajectoryDataset

CACHE_FILE = "mmrl_cache.json"


def to_tensor(frames: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``frames uint8 [N, H, W, 3]`` -> ``float32 [N, 3, H, W]`` in [-1, 1]."""
    frames = torch.as_tensor(frames)
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(
            f"expected frames uint8 [N, H, W, 3], found {frames.dtype} {list(frames.shape)}"
        )
    return frames.permute(0, 3, 1, 2).float() / 127.5 - 1.0


def to_frames(images: torch.Tensor) -> np.ndarray:
    """``float [N, 3, H, W]`` in [-1, 1] -> ``frames uint8 [N, H, W, 3]`` (clamped, rounded)."""
    pixels = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round()
    return pixels.to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def psnr(pred: np.ndarray, target: np.ndarray) -> float:
    """Mean over frames of the per-frame PSNR in dB of ``uint8 [N, H, W, 3]`` frames (capped at
    60)."""
    err = (pred.astype(np.float64) - target.astype(np.float64)) ** 2
    mse = err.reshape(len(err), -1).mean(axis=1)
    return float(np.mean(10 * np.log10(255.0**2 / np.maximum(mse, 255.0**2 * 1e-6))))


def load_frames(dataset_dir: str | Path) -> np.ndarray:
    """All frames of a trajectory dataset, flattened to ``uint8 [sum T, H, W, 3]``."""
    return np.concatenate(list(TrajectoryDataset(dataset_dir).frames()))


def cache_key(dataset_dir: str | Path, **settings: Any) -> str:
    """sha256 of the settings and the dataset's ``index.json``."""
    index = json.loads((Path(dataset_dir) / INDEX_FILE).read_text())
    blob = json.dumps({"data_index": index, **settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def cached(out_dir: str | Path, key: str) -> dict[str, Any] | None:
    """The cache record in ``out_dir`` if it was written for ``key``, else None."""
    path = Path(out_dir) / CACHE_FILE
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    return record if record.get("key") == key else None


def write_cache(out_dir: str | Path, key: str, record: dict[str, Any]) -> None:
    (Path(out_dir) / CACHE_FILE).write_text(
        json.dumps({"key": key, **record}, indent=1, default=str)
    )


def colour_weights(frames: np.ndarray, max_weight: float) -> torch.Tensor:
    """Per-colour loss weights ``float32 [4096]`` from ``frames uint8 [N, H, W, 3]``.

    Colours are binned to 4 bits per channel; a colour seen with frequency ``p``
    weighs ``sqrt(p_max / p)``, clipped to ``[1, max_weight]``. Small objects (an
    agent cell, a 21-px disc) are rare colours; without the weight an autoencoder
    first learns the background and can stall there. In natural video most colours
    are rare alike, so the weights stay near uniform.
    """
    counts = np.bincount(colour_bins(frames).reshape(-1), minlength=4096).astype(np.float64)
    with np.errstate(divide="ignore"):
        w = np.sqrt(counts.max() / counts)
    return torch.from_numpy(np.clip(np.nan_to_num(w, posinf=max_weight), 1.0, max_weight)).float()


def colour_bins(frames: np.ndarray) -> np.ndarray:
    """``uint8 [..., 3]`` -> int64 [...] colour bin (4 bits per channel)."""
    q = frames.astype(np.int64) >> 4
    return (q[..., 0] << 8) | (q[..., 1] << 4) | q[..., 2]


def weighted_mse(
    recon: torch.Tensor, x: torch.Tensor, frames: np.ndarray, weights: torch.Tensor
) -> torch.Tensor:
    """MSE of ``recon`` vs ``x [N, 3, H, W]``, each pixel weighted by its colour in ``frames uint8
    [N, H, W, 3]``.
    """
    w = weights[torch.from_numpy(colour_bins(frames))][:, None]
    return (w * (recon - x) ** 2).mean() / w.mean()


def batches(n: int, batch_size: int) -> list[slice]:
    return [slice(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


# loss_fn(x [B, 3, H, W] in [-1, 1], batch uint8 [B, H, W, 3], colour weights) -> loss
CodecLoss = Callable[[torch.Tensor, np.ndarray, torch.Tensor], torch.Tensor]


def train_codec(
    model: torch.nn.Module,
    frames: np.ndarray,
    train: Any,
    loss_fn: CodecLoss,
    desc: str,
    progress: bool = True,
    after_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Adam on random batches of ``frames uint8 [N, H, W, 3]``; returns the loss per step.

    ``train`` has ``steps``, ``batch_size``, ``lr``, ``seed`` and ``rare_colour_weight``;
    ``after_step(step)`` runs after each update (the VQ tokenizer restarts dead codes there).
    """
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=train.lr)
    rng = np.random.default_rng(train.seed)
    weights = colour_weights(frames, train.rare_colour_weight)
    losses: list[float] = []
    bar = tqdm(range(train.steps), desc=desc, disable=not progress)
    for step in bar:
        batch = frames[rng.integers(0, len(frames), train.batch_size)]
        loss = loss_fn(to_tensor(batch), batch, weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses
