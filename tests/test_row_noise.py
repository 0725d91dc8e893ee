"""Latent and flow rollouts draw each row's noise from that row's seed, as the token engines
do: a row samples the same future whether its rank holds the whole batch or half of it, and
rows with the same prompt but different seeds explore differently."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrl.hybrid.actor import compute_log_probs
from mmrl.models import get_family
from mmrl.models.flow_policy import FlowPolicyConfig, FlowVelocityPolicy
from mmrl.models.latent_policy import GaussianLatentPolicy, LatentPolicyConfig
from mmrl.models.row_noise import RowNoise, standard_normal
from mmrl.protocol import Batch
from mmrl.rollout import get_rollout
from mmrl.sampling import SamplingParams
from mmrl.trainer.experience import with_row_seeds


def latent_policy() -> GaussianLatentPolicy:
    torch.manual_seed(0)
    cfg = LatentPolicyConfig(latent_channels=4, latent_size=8, context=2, action_dim=2, hidden=16)
    return GaussianLatentPolicy(cfg)


def flow_policy() -> FlowVelocityPolicy:
    torch.manual_seed(0)
    cfg = FlowPolicyConfig(block_out_channels=[8, 16], norm_num_groups=4, num_steps=3)
    return FlowVelocityPolicy(cfg)


def group_prompts(groups: int = 2, n: int = 2, f: int = 2) -> Batch:
    """``groups`` prompts, each repeated ``n`` times as the trainer repeats them."""
    g = torch.Generator().manual_seed(0)
    base = Batch.from_dict(
        {
            "context_latents": torch.randn(groups, 2, 4, 8, 8, generator=g),
            "actions": torch.rand(groups, 2 + f - 1, 2, generator=g) * 2 - 1,
            "attention_mask": torch.ones(groups, 2, dtype=torch.long),
            "position_ids": torch.arange(2).expand(groups, 2).clone(),
        },
        non_tensor={"uid": np.asarray([str(i) for i in range(groups)], dtype=object)},
    )
    return with_row_seeds(base.repeat(n, interleave=True), seed=11)


# The Gaussian head is exact across splits; the U-Net's convolutions sum in a batch-size
# dependent order, so its samples agree to float rounding (7e-7 seen) and the 1e-4.
@pytest.mark.parametrize(
    ("family", "make_policy", "atol"),
    [("latent", latent_policy, 0.0), ("flow_latent", flow_policy, 1e-4)],
)
def test_a_row_samples_the_same_future_in_any_split_and_seeds_differ(family, make_policy, atol):
    fam, model = get_family(family), make_policy()
    engine = get_rollout("latent")(model=model, family=fam)
    # A step seed that is the same on every rank: only the per-row seeds may tell rows apart.
    params = SamplingParams(max_tokens=2, min_tokens=2, seed=7)
    batch = group_prompts()
    whole = engine.generate(batch, params)
    halves = [engine.generate(batch[i : i + 2], params) for i in (0, 2)]
    for key in ("response_latents", "rollout_log_probs", "response_mask"):
        split = torch.cat([h[key] for h in halves])
        assert torch.allclose(split.float(), whole[key].float(), rtol=0.0, atol=atol), key
    # Rows 0 and 1 share a prompt: their own seeds, not the call, make them explore apart.
    latents = whole["response_latents"]
    assert not torch.allclose(latents[0], latents[1])
    # Before the fix, rank 1's first row drew rank 0's first row's noise.
    assert not torch.allclose(halves[1]["response_latents"][0], halves[0]["response_latents"][0])
    recomputed = compute_log_probs(fam, model, whole, micro_batch_size=4, temperature=1.0)
    keep = whole["response_mask"].bool()
    assert torch.allclose(recomputed[keep], whole["rollout_log_probs"][keep], atol=1e-4)


def test_row_noise_is_per_row_and_checks_its_rows():
    noise = standard_normal((3, 5), RowNoise([1, 2, 1], 3))
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])
    assert torch.equal(noise[1], torch.randn(5, generator=torch.Generator().manual_seed(2)))
    with pytest.raises(ValueError, match="2 row seeds for 3 rows"):
        RowNoise([1, 2], 3)
    with pytest.raises(ValueError, match="noise for 4 rows from 3 generators"):
        standard_normal((4, 5), RowNoise(None, 3))
