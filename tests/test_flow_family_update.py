"""The flow family under the shared PPO code: denoising steps are weighed as tokens are.

Each loss aggregation mode and each sample-based KL estimator reaches the update's gradient,
and that gradient does not depend on how the rows are split into micro-batches; truncated
importance sampling weighs each step by its own density ratio, capped.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mmrl import algos
from mmrl.config.fields import AGG_MODES
from mmrl.hybrid.actor import compute_log_probs

# one_thread is test_flow_family's autouse fixture: imported, it runs this module on one
# intra-op thread too.
from tests.test_flow_family import FLOW, one_thread, policy, prompts, rollout  # noqa: F401
from tests.test_step_exactness import assert_same_grads, step_grads

B = 6


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with every weight moved by ``scale`` standard normals."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return other


@pytest.fixture(scope="module")
def setup():
    """A policy, its rollout (one row invalid, two rows with fewer trained steps) with old and
    reference log-densities, and per-step advantages that differ between rows and steps."""
    model = policy(seed=1)
    out = rollout(model, prompts(B, f=2))
    # Rows train different numbers of steps, as token responses differ in length, so that
    # the per-row and the per-step means differ.
    out["response_mask"][0, :2] = 0
    out["response_mask"][1, 4] = 0
    out["old_log_probs"] = compute_log_probs(FLOW, model, out, B, 1.0)
    out["ref_log_prob"] = compute_log_probs(FLOW, perturbed(model, 1e-3, 0), out, B, 1.0)
    g = torch.Generator().manual_seed(2)
    out["advantages"] = torch.randn(out["response_mask"].shape, generator=g)
    out["valid_mask"] = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    return model, out


def applied_gradient(model, batch, micro: int, **actor) -> tuple[dict, dict]:
    """The gradient one update applies (``step_grads``) to the flow policy, in micro-batches
    of ``micro`` rows."""
    return step_grads(
        model, batch, True, FLOW, 1.0, ppo_micro_batch_size=micro, grad_clip=1e12, **actor
    )


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads.values()])


def test_every_aggregation_mode_gives_one_gradient_whatever_the_micro_batches(setup):
    model, batch = setup
    by_mode = {}
    for mode in AGG_MODES:
        whole, metrics = applied_gradient(model, batch, B, loss_agg_mode=mode)
        split, _ = applied_gradient(model, batch, 2, loss_agg_mode=mode)
        assert_same_grads(split, whole)
        assert metrics["actor/pg_clipfrac"] == 0.0  # on-policy: every ratio is 1
        by_mode[mode] = flat(whole)
    # The mode reaches the loss: each weighs the steps otherwise.
    modes = list(by_mode)
    for i, a in enumerate(modes):
        for b in modes[i + 1 :]:
            assert not torch.allclose(by_mode[a], by_mode[b], rtol=1e-3), (a, b)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_sample_based_kl_estimators_apply_per_denoising_step(setup, kind):
    model, batch = setup
    actor = dict(use_kl_loss=True, kl_loss_type=kind, kl_loss_coef=0.5)
    whole, metrics = applied_gradient(model, batch, B, **actor)
    split, _ = applied_gradient(model, batch, 3, **actor)
    assert_same_grads(split, whole)
    # The estimator over the trained steps of valid rows, as the actor aggregates it.
    log_ratio = batch["old_log_probs"] - batch["ref_log_prob"]
    mask = batch["response_mask"] * batch["valid_mask"][:, None]
    want = algos.kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], kind)
    want = float((want * mask).sum() / mask.sum())
    assert metrics["actor/kl_loss"] == pytest.approx(want, rel=1e-4, abs=1e-7)
    assert float(log_ratio[mask.bool()].abs().max()) > 0  # the reference differs
    no_kl, _ = applied_gradient(model, batch, B)
    assert not torch.allclose(flat(whole), flat(no_kl), rtol=1e-4)


def test_truncated_importance_sampling_weighs_each_denoising_step():
    """A rollout sampled by a slightly stale policy: the weights are the capped per-step
    density ratios, 1 off the trained steps, and they scale the gradient as advantages."""
    sampler = policy(seed=1)
    trainer = perturbed(sampler, 2e-3, 1)
    batch = rollout(sampler, prompts(B, f=2))
    old = compute_log_probs(FLOW, trainer, batch, B, 1.0)
    mask = batch["response_mask"]
    keep = mask.bool()
    weights, metrics = algos.rollout_is_weights(
        old, batch["rollout_log_probs"], mask, "token", cap=2.0
    )
    ratio = (old - batch["rollout_log_probs"]).exp()
    torch.testing.assert_close(weights[keep], ratio[keep].clamp(max=2.0))
    assert (weights[~keep] == 1).all()
    assert metrics["rollout_is/min"] < 0.99 and metrics["rollout_is/max"] > 1.01, metrics
    batch["old_log_probs"] = old
    batch["advantages"] = torch.ones_like(old) * torch.linspace(-1, 1, B)[:, None]
    batch["valid_mask"] = torch.ones(B, dtype=torch.bool)
    unweighted, _ = applied_gradient(trainer, batch, B)
    weighted_batch = batch.clone()
    weighted_batch["rollout_is_weights"] = weights
    weighted, _ = applied_gradient(trainer, weighted_batch, 2)
    by_hand = batch.clone()
    by_hand["advantages"] = batch["advantages"] * weights
    assert_same_grads(weighted, applied_gradient(trainer, by_hand, B)[0])
    assert not torch.allclose(flat(weighted), flat(unweighted), rtol=1e-3)
