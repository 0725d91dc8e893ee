"""The Gaussian latent policy: exact log-density, shapes, save/load."""

import pytest
import torch

from mmrl.models.latent_policy import (
    GaussianLatentPolicy,
    LatentPolicyConfig,
    gaussian_log_prob,
)

CFG = LatentPolicyConfig(latent_channels=4, latent_size=8, context=2, action_dim=2, hidden=16)


def inputs(b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, 4, 8, 8, generator=g), torch.randn(b, 2, 2, generator=g)


def test_log_prob_is_the_exact_gaussian_density_summed_over_dims():
    torch.manual_seed(0)
    policy = GaussianLatentPolicy(CFG)
    torch.nn.init.normal_(policy.out.weight, std=0.1)  # non-trivial mean and std
    ctx, act = inputs()
    target = torch.randn(3, 4, 8, 8)
    mean, log_std = policy(ctx, act)
    expected = torch.distributions.Normal(mean, log_std.exp()).log_prob(target).flatten(1).sum(1)
    assert torch.allclose(policy.log_prob(ctx, act, target), expected, atol=1e-4)
    assert (log_std >= CFG.min_log_std).all() and (log_std <= CFG.max_log_std).all()
    z, lp = policy.sample(ctx, act, generator=torch.Generator().manual_seed(1))
    assert z.shape == (3, 4, 8, 8) and torch.allclose(lp, policy.log_prob(ctx, act, z), atol=1e-4)
    greedy, _ = policy.sample(ctx, act, greedy=True)
    assert torch.equal(greedy, mean)


def test_untrained_policy_predicts_the_last_latent_and_shape_errors_are_clear():
    policy = GaussianLatentPolicy(CFG)
    ctx, act = inputs()
    mean, _ = policy(ctx, act)
    assert torch.equal(mean, ctx[:, -1])
    with pytest.raises(ValueError, match=r"actions \[B, 2, 2\]"):
        policy(ctx, act[:, :1])
    assert gaussian_log_prob(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3)).shape == (2,)


def test_save_and_load(tmp_path):
    policy = GaussianLatentPolicy(CFG)
    torch.nn.init.normal_(policy.out.weight, std=0.1)
    policy.save_pretrained(tmp_path)
    loaded = GaussianLatentPolicy.from_pretrained(tmp_path)
    ctx, act = inputs()
    assert torch.equal(policy(ctx, act)[0], loaded(ctx, act)[0])
