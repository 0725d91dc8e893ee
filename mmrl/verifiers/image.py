"""Pixel-space frame verifiers: PSNR, SSIM (torchmetrics), MAE and MSE.

All read ``pred_frames`` / ``gt_frames`` [B, F, H, W, 3] (see :mod:`mmrl.verifiers.frames`),
compute on the tensors' device in one batched call, and aggregate over frames with
``aggregate`` = mean | last | discounted (``gamma``). PSNR and SSIM are similarities
(higher is better); MAE and MSE are errors, so give them a negative weight,
e.g. ``-(mae + lpips)``.
"""

from __future__ import annotations

from torch import Tensor

from mmrl.protocol import Batch
from mmrl.verifiers.base import VerifierOutput, register_verifier
from mmrl.verifiers.frames import score_frames

# PSNR of identical frames is infinite; scores are capped here (an MSE of 1e-10).
MAX_PSNR_DB = 100.0


def psnr_per_frame(pred: Tensor, gt: Tensor) -> Tensor:
    """PSNR in dB with data range 1, at most ``MAX_PSNR_DB``. pred, gt: [N, 3, H, W] in [0, 1].
    Returns [N].
    """
    from torchmetrics.functional.image import peak_signal_noise_ratio

    psnr = peak_signal_noise_ratio(pred, gt, data_range=1.0, reduction="none", dim=(1, 2, 3))
    return psnr.clamp(max=MAX_PSNR_DB)  # NaN stays NaN and marks the sample invalid


def ssim_per_frame(pred: Tensor, gt: Tensor) -> Tensor:
    """SSIM (Gaussian window 11, sigma 1.5, data range 1, mean over RGB). [N, 3, H, W] -> [N]."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    return structural_similarity_index_measure(pred, gt, data_range=1.0, reduction="none")


def mae_per_frame(pred: Tensor, gt: Tensor) -> Tensor:
    """Mean absolute error over pixels and channels, in [0, 1] units. [N, 3, H, W] -> [N]."""
    return (pred - gt).abs().mean(dim=(1, 2, 3))


def mse_per_frame(pred: Tensor, gt: Tensor) -> Tensor:
    """Mean squared error over pixels and channels, in [0, 1] units. [N, 3, H, W] -> [N]."""
    return (pred - gt).square().mean(dim=(1, 2, 3))


@register_verifier("psnr")
def psnr(batch: Batch, aggregate: str = "mean", gamma: float = 0.9) -> VerifierOutput:
    """PSNR (dB, capped at 100) per sample, aggregated over its F frames."""
    return score_frames(batch, psnr_per_frame, aggregate, gamma)


@register_verifier("ssim")
def ssim(batch: Batch, aggregate: str = "mean", gamma: float = 0.9) -> VerifierOutput:
    """SSIM in [-1, 1] per sample, aggregated over its F frames; frames need H, W >= 11."""
    return score_frames(batch, ssim_per_frame, aggregate, gamma)


@register_verifier("mae")
def mae(batch: Batch, aggregate: str = "mean", gamma: float = 0.9) -> VerifierOutput:
    """Mean absolute pixel error per sample (an error: weight it negatively)."""
    return score_frames(batch, mae_per_frame, aggregate, gamma)


@register_verifier("mse")
def mse(batch: Batch, aggregate: str = "mean", gamma: float = 0.9) -> VerifierOutput:
    """Mean squared pixel error per sample (an error: weight it negatively)."""
    return score_frames(batch, mse_per_frame, aggregate, gamma)
