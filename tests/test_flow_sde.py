"""The flow sampler's math: the SDE keeps the ODE's marginals, each step's log-density is exact,
and GRPO over denoising steps (mmrl's own advantage and loss functions) moves samples toward
reward."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from mmrl import algos
from mmrl.config import ActorConfig, AlgorithmConfig
from mmrl.models.flow_sde import (
    sample_step,
    step_distribution,
    step_entropy,
    step_log_prob,
    time_grid,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tensors this small run fastest on one intra-op thread (two threads wait on each other
    when the cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sample_paths(velocity, n: int, steps: int, noise_level: float, seed: int, dims: int = 1):
    """``path [n, steps + 1, dims]`` from noise to samples, and each step's log-density."""
    g = torch.Generator().manual_seed(seed)
    grid = time_grid(steps)
    x = torch.randn(n, dims, generator=g)
    path, log_probs = [x], []
    for k in range(steps):
        t, t_next = grid[k].expand(n), grid[k + 1].expand(n)
        mean, std = step_distribution(x, velocity(x, t), t, t_next, noise_level, float(grid[1]))
        x = sample_step(mean, std, g)
        path.append(x)
        log_probs.append(step_log_prob(x, mean, std))
    return torch.stack(path, 1), torch.stack(log_probs, 1)


def gaussian_velocity(mu: float, s: float):
    """The exact rectified-flow velocity E[eps - x0 | x_t] for data x0 ~ N(mu, s^2)."""

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = t.view(-1, 1)
        var = (1 - t) ** 2 * s**2 + t**2
        return (t - (1 - t) * s**2) / var * (x - (1 - t) * mu) - mu

    return velocity


def test_step_log_prob_is_the_exact_gaussian_density_and_the_last_step_is_deterministic():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(5, 4, 8, 8, generator=g), torch.randn(5, 4, 8, 8, generator=g)
    grid = time_grid(4)
    t, t_next = torch.full((5,), 0.5), torch.full((5,), 0.25)
    mean, std = step_distribution(x, v, t, t_next, 0.7, float(grid[1]))
    sigma = 0.7 * math.sqrt(0.5 / 0.5)
    assert torch.allclose(std, torch.full((5,), sigma * math.sqrt(0.25)))
    expected_mean = x + (v + sigma**2 / (2 * 0.5) * (x + 0.5 * v)) * -0.25
    assert torch.allclose(mean, expected_mean, atol=1e-6)
    z = sample_step(mean, std, g)
    ref = torch.distributions.Normal(mean, std.view(-1, 1, 1, 1)).log_prob(z).flatten(1).sum(1)
    assert torch.allclose(step_log_prob(z, mean, std), ref, atol=1e-3)
    entropy = torch.distributions.Normal(mean, std.view(-1, 1, 1, 1)).entropy().flatten(1).sum(1)
    assert torch.allclose(step_entropy(std, 256), entropy, atol=1e-3)
    # The step to t = 0 is Euler's ODE step: no noise, no density; noise 0 is the ODE everywhere.
    last_mean, last_std = step_distribution(x, v, t, torch.zeros(5), 0.7, float(grid[1]))
    assert torch.equal(last_std, torch.zeros(5)) and torch.allclose(last_mean, x - 0.5 * v)
    assert torch.equal(sample_step(last_mean, last_std, g), last_mean)
    assert torch.equal(step_log_prob(last_mean, last_mean, last_std), torch.zeros(5))
    ode_mean, ode_std = step_distribution(x, v, t, t_next, 0.0, float(grid[1]))
    assert torch.equal(ode_std, torch.zeros(5)) and torch.allclose(ode_mean, x - 0.25 * v)
    # The first step (t = 1) has finite noise.
    _, first_std = step_distribution(x, v, torch.ones(5), torch.full((5,), 0.75), 0.7, 0.75)
    assert torch.isfinite(first_std).all() and (first_std > 0).all()


@pytest.mark.parametrize("noise_level", [0.3, 0.7])
def test_sde_keeps_the_odes_marginals_on_a_gaussian(noise_level):
    """Data ~ N(1.5, 0.5^2) with its exact velocity field: SDE samples (independent seeds) have
    the ODE's mean and standard deviation within 3 standard errors, n = 10k, 200 steps."""
    velocity, n = gaussian_velocity(1.5, 0.5), 10_000
    ode = sample_paths(velocity, n, 200, 0.0, seed=1)[0][:, -1, 0]
    sde = sample_paths(velocity, n, 200, noise_level, seed=2)[0][:, -1, 0]
    se_mean = math.sqrt((ode.var() + sde.var()).item() / n)
    se_std = math.sqrt((ode.var() + sde.var()).item() / (2 * n))
    assert abs(sde.mean() - ode.mean()) < 3 * se_mean, (sde.mean(), ode.mean(), se_mean)
    assert abs(sde.std() - ode.std()) < 3 * se_std, (sde.std(), ode.std(), se_std)
    assert abs(ode.std() - 0.5) < 3 * se_std  # and both are the data's distribution


class ToyVelocity(nn.Module):
    """A tiny velocity MLP over (x, t) in one dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU(),
                                 nn.Linear(32, 1))  # fmt: skip

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t.view(-1, 1).expand_as(x)], dim=1))


def recompute_log_probs(model, path, steps: int, noise_level: float) -> torch.Tensor:
    """Each recorded step's log-density ``[n, steps]`` under ``model``, in one forward."""
    n, grid = path.shape[0], time_grid(steps)
    x = path[:, :-1].reshape(n * steps, 1)
    t, t_next = grid[:-1].repeat(n), grid[1:].repeat(n)
    mean, std = step_distribution(x, model(x, t), t, t_next, noise_level, float(grid[1]))
    return step_log_prob(path[:, 1:].reshape(n * steps, 1), mean, std).view(n, steps)


def test_grpo_over_sde_steps_moves_samples_toward_the_reward():
    """Pretrained on N(0, 1), rewarded -(x - 2)^2: GRPO (mmrl's grpo advantage and vanilla PPO
    loss over the stochastic denoising steps) moves the sample mean toward 2 by more than 3
    standard errors."""
    torch.manual_seed(0)
    model, steps, a = ToyVelocity(), 6, 0.7
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(200):  # flow-matching pretraining on N(0, 1)
        x0, eps, t = torch.randn(256, 1), torch.randn(256, 1), torch.rand(256)
        x_t = (1 - t.view(-1, 1)) * x0 + t.view(-1, 1) * eps
        loss = ((model(x_t, t) - (eps - x0)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def final_samples(seed: int) -> torch.Tensor:
        with torch.no_grad():
            return sample_paths(model, 4000, steps, a, seed)[0][:, -1, 0]

    before = final_samples(100)
    groups, n = 16, 16
    mask = torch.ones(groups * n, steps)
    mask[:, -1] = 0  # the last step is deterministic: not a policy step
    index = np.repeat(np.arange(groups), n)
    actor = ActorConfig()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for it in range(6):
        with torch.no_grad():
            path, rollout_log_probs = sample_paths(model, groups * n, steps, a, seed=it)
        rewards = torch.zeros(groups * n, steps)
        rewards[:, steps - 2] = -((path[:, -1, 0] - 2.0) ** 2)  # on the last policy step
        advantages, _ = algos.get_adv_estimator("grpo")(
            token_level_rewards=rewards, response_mask=mask, index=index, config=AlgorithmConfig()
        )
        for _ in range(2):
            log_probs = recompute_log_probs(model, path, steps, a)
            loss, _ = algos.get_policy_loss("vanilla")(
                old_log_prob=rollout_log_probs,
                log_prob=log_probs,
                advantages=advantages,
                response_mask=mask,
                config=actor,
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    after = final_samples(100)
    se = math.sqrt((before.var() + after.var()).item() / len(before))
    assert after.mean() - before.mean() > 3 * se, (before.mean(), after.mean(), se)
    assert abs(after.mean() - 2) < abs(before.mean() - 2)
