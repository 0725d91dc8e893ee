"""Rectified-flow sampling as a sequence of Gaussian policy steps (Flow-GRPO's SDE).

Convention: ``x_t = (1 - t) x_0 + t eps`` with data ``x_0`` at ``t = 0`` and noise
``eps ~ N(0, I)`` at ``t = 1``; a velocity model predicts ``v = eps - x_0``. Sampling walks
a time grid ``1 = t_0 > t_1 > ... > t_S = 0`` in ``S`` denoising steps.

The ODE step is Euler's, ``x_next = x_t + v dt`` with ``dt = t_next - t < 0``. The SDE step
with the same marginals ``p_t`` adds the score term and noise:

    x_next = x_t + [v + sigma_t^2 / (2 t) * (x_t + (1 - t) v)] dt + sigma_t sqrt(-dt) eps,
    sigma_t = a * sqrt(t / (1 - t)),

using ``grad log p_t(x) = -(x + (1 - t) v) / t`` for this interpolation. ``a`` is the noise
level: ``a = 0`` is the ODE, larger ``a`` explores more. At ``t = 1`` the ``1 - t`` under the
root is taken at the grid's next time, so the first step's noise stays finite. The last step
(to ``t = 0``) is always the ODE's: it is deterministic and carries no density. Every other
step is a Gaussian ``N(mean, std^2 I)`` whose log-density (:func:`step_log_prob`) is exact, so
PPO ratios and KL estimators apply to it as to a token.
"""

from __future__ import annotations

import math

import torch

from mmrl.models.row_noise import RowNoise, standard_normal


def time_grid(steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[steps + 1]`` times from 1 (noise) down to 0 (data), evenly spaced."""
    if steps < 1:
        raise ValueError(f"a flow sampler needs at least one denoising step, found {steps}")
    return torch.linspace(1.0, 0.0, steps + 1, dtype=dtype)


def sde_sigma(t: torch.Tensor, t_cap: float, noise_level: float) -> torch.Tensor:
    """``sigma_t = a sqrt(t / (1 - min(t, t_cap)))`` per row (``t [B]``); ``t_cap < 1`` is the
    grid's second time, which keeps the first step finite."""
    return noise_level * torch.sqrt(t / (1.0 - t.clamp(max=t_cap)))


def step_distribution(
    x: torch.Tensor,
    velocity: torch.Tensor,
    t: torch.Tensor,
    t_next: torch.Tensor,
    noise_level: float,
    t_cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gaussian of one denoising step: ``mean [B, ...]`` and ``std [B]``.

    ``x`` and ``velocity`` ``[B, ...]`` at times ``t [B]``, stepping to ``t_next [B]``. Rows
    stepping to ``t_next = 0`` (and every row when ``noise_level = 0``) get the ODE's Euler
    step and ``std = 0``.
    """
    shape = (-1,) + (1,) * (x.dim() - 1)
    last = t_next <= 0
    sigma = torch.where(last, torch.zeros_like(t), sde_sigma(t, t_cap, noise_level))
    dt = (t_next - t).view(shape)
    drift = velocity + (sigma**2 / (2 * t)).view(shape) * (x + (1 - t).view(shape) * velocity)
    return x + drift * dt, sigma * torch.sqrt(t - t_next)


def sample_step(
    mean: torch.Tensor, std: torch.Tensor, generator: torch.Generator | RowNoise | None = None
) -> torch.Tensor:
    """A draw from ``N(mean, std^2 I)`` (``std [B]``; ``std = 0`` returns ``mean``). The noise
    is drawn on the CPU from ``generator`` (one, or one per row), so a seed gives the same path
    on any device."""
    noise = standard_normal(mean.shape, generator, mean.dtype).to(mean.device)
    return mean + std.view((-1,) + (1,) * (mean.dim() - 1)) * noise


def step_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Exact ``log N(sample; mean, std^2 I)`` summed over all dims but the first: ``[B]``.

    Rows with ``std = 0`` (deterministic steps) have no density: they get 0.
    """
    stochastic = std > 0
    safe = torch.where(stochastic, std, torch.ones_like(std))
    z = (sample - mean) / safe.view((-1,) + (1,) * (mean.dim() - 1))
    dims = mean[0].numel()
    log_prob = -0.5 * z.pow(2).flatten(1).sum(1) - dims * (
        torch.log(safe) + 0.5 * math.log(2 * math.pi)
    )
    return torch.where(stochastic, log_prob, torch.zeros_like(log_prob))


def step_entropy(std: torch.Tensor, dims: int) -> torch.Tensor:
    """Entropy ``[B]`` of ``N(., std^2 I)`` in ``dims`` dimensions; 0 where ``std = 0``."""
    safe = torch.where(std > 0, std, torch.ones_like(std))
    entropy = dims * (torch.log(safe) + 0.5 * (1.0 + math.log(2 * math.pi)))
    return torch.where(std > 0, entropy, torch.zeros_like(entropy))


__all__ = [
    "sample_step",
    "sde_sigma",
    "step_distribution",
    "step_entropy",
    "step_log_prob",
    "time_grid",
]
