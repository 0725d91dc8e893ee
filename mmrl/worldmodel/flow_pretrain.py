"""Flow-matching pretraining of the velocity world model, on the latent policy's windows."""

from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from mmrl.models.flow_policy import FlowVelocityPolicy, flow_matching_loss
from mmrl.models.flow_sde import step_distribution, time_grid

Windows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # context, actions, target


@torch.no_grad()
def ode_predict(
    policy: FlowVelocityPolicy, context: torch.Tensor, actions: torch.Tensor, seed: int = 0
) -> torch.Tensor:
    """The next latent ``[B, C, h, w]`` by integrating the ODE from seeded noise in the policy's
    ``num_steps``."""
    b, steps = context.shape[0], policy.cfg.num_steps
    grid = time_grid(steps).to(context)
    x = torch.randn(context[:, 0].shape, generator=torch.Generator().manual_seed(seed)).to(context)
    for k in range(steps):
        t, t_next = grid[k].expand(b), grid[k + 1].expand(b)
        velocity = policy(x, t, context, actions)
        x = step_distribution(x, velocity, t, t_next, 0.0, float(grid[1]))[0]
    return x


def pretrain_flow_policy(
    policy: FlowVelocityPolicy,
    train: Windows,
    val: Windows,
    steps: int = 800,
    batch_size: int = 64,
    lr: float = 1e-3,
    val_every: int = 100,
    val_windows: int = 256,
    seed: int = 0,
    progress: bool = True,
) -> list[dict[str, float]]:
    """Rectified-flow regression of the velocity (random ``t`` and noise per window).

    Returns one record per validation: ``step``, ``train/loss`` (the last batch's) and, on up
    to ``val_windows`` held-out windows, ``val/loss`` (the same regression with fixed noise)
    and ``val/mse`` of the ODE's prediction against the true next latent.
    """
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    pick = np.linspace(0, len(val[0]) - 1, min(val_windows, len(val[0]))).round().astype(int)
    held = tuple(v[torch.from_numpy(pick)] for v in val)
    history: list[dict[str, float]] = []
    bar = tqdm(range(1, steps + 1), desc="pretrain flow policy", disable=not progress)
    for step in bar:
        idx = torch.from_numpy(rng.integers(0, len(train[0]), batch_size))
        loss = flow_matching_loss(policy, train[0][idx], train[1][idx], train[2][idx], generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        if step % val_every == 0 or step == steps:
            policy.eval()
            with torch.no_grad():
                val_loss = flow_matching_loss(policy, *held, torch.Generator().manual_seed(seed))
                mse = torch.mean((ode_predict(policy, held[0], held[1], seed) - held[2]) ** 2)
            policy.train()
            history.append({"step": step, "train/loss": loss.item(), "val/loss": val_loss.item(),
                            "val/mse": mse.item()})  # fmt: skip
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{val_loss.item():.3f}")
    return history
