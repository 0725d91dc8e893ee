"""Maximum-likelihood pretraining of the Gaussian latent world-model policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from mmrl.models.latent_policy import GaussianLatentPolicy
from mmrl.worldmodel.data import TrajectoryDataset
from mmrl.worldmodel.latent_ae import LatentAutoencoder


def latent_windows(
    dataset_dir: str | Path, ae: LatentAutoencoder, context: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All windows: ``context [M, K, C, h, w]``, ``actions [M, K, A]``, ``target [M, C, h, w]``."""
    data = TrajectoryDataset(dataset_dir)
    # Recorded episodes differ in length: encode all frames at once, then split per trajectory.
    lengths = [data.num_frames(i) for i in range(len(data))]
    z_all = ae.encode(np.concatenate(list(data.frames())))
    ctx, act, target = [], [], []
    for i, z in enumerate(torch.split(z_all, lengths)):
        actions = torch.from_numpy(data.trajectory(i).actions)
        for s in range(lengths[i] - context):
            ctx.append(z[s : s + context])
            act.append(actions[s : s + context])
            target.append(z[s + context])
    if not ctx:
        raise ValueError(f"{dataset_dir}: no trajectory has more than {context} frames")
    ctx, act, target = torch.stack(ctx), torch.stack(act), torch.stack(target)
    return ctx, act, target


def pretrain_latent_policy(
    policy: GaussianLatentPolicy,
    train: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    val: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    steps: int = 500,
    batch_size: int = 64,
    lr: float = 1e-3,
    val_every: int = 50,
    seed: int = 0,
    progress: bool = True,
) -> list[dict[str, float]]:
    """Maximum likelihood: minimise the negative log-density per latent dimension.

    Returns one record per validation: ``step``, ``train/nll`` and ``val/nll``
    (nats per dimension) and ``val/mse`` of the mean.
    """
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    dims = float(np.prod(train[2].shape[1:]))
    history: list[dict[str, float]] = []
    bar = tqdm(range(1, steps + 1), desc="pretrain latent policy", disable=not progress)
    for step in bar:
        idx = torch.from_numpy(rng.integers(0, len(train[0]), batch_size))
        nll = -policy.log_prob(train[0][idx], train[1][idx], train[2][idx]).mean() / dims
        optimizer.zero_grad(set_to_none=True)
        nll.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        if step % val_every == 0 or step == steps:
            with torch.no_grad():
                mean, _ = policy(val[0], val[1])
                val_nll = -policy.log_prob(*val).mean().item() / dims
                history.append({"step": step, "train/nll": nll.item(), "val/nll": val_nll,
                                "val/mse": torch.mean((mean - val[2]) ** 2).item()})  # fmt: skip
            bar.set_postfix(nll=f"{nll.item():.3f}", val=f"{val_nll:.3f}")
    return history
