"""Each formula in mmrl.algos against a plain-Python reference on small tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmrl.algos import (
    ADV_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_value_loss,
    entropy_from_logits,
    get_adv_estimator,
    get_policy_loss,
    kl_penalty,
    register_adv_estimator,
    rollout_is_weights,
)
from mmrl.config import ActorConfig, AlgorithmConfig, PolicyLossConfig

T = 4


def outcome_batch(scores: list[float], lengths: list[int], t: int = T):
    """Rewards [B, t] with each score on the last valid step, and the right-padded mask."""
    rewards = torch.zeros(len(scores), t)
    mask = torch.zeros(len(scores), t)
    for i, (s, n) in enumerate(zip(scores, lengths, strict=True)):
        mask[i, :n] = 1
        if n:
            rewards[i, n - 1] = s
    return rewards, mask


def broadcast(per_sample: list[float], lengths: list[int], t: int = T) -> torch.Tensor:
    return torch.tensor(
        [[a if j < n else 0.0 for j in range(t)] for a, n in zip(per_sample, lengths, strict=True)]
    )


def ref_whiten(rows: list[list[float]], keep: list[list[bool]]) -> list[list[float]]:
    flat = [x for r, k in zip(rows, keep, strict=True) for x, m in zip(r, k, strict=True) if m]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [
        [(x - mean) / math.sqrt(var + 1e-8) if m else 0.0 for x, m in zip(r, k, strict=True)]
        for r, k in zip(rows, keep, strict=True)
    ]


# --------------------------------------------------------------------------- GRPO / RLOO

UIDS = ["a", "a", "a", "a", "b", "b", "b", "c", "d", "d", "d", "e", "e"]
SCORES = [1.0, 0.0, 1.0, 0.5, 0.3, 0.3, 0.3, 2.0, 1.0, 7.0, 3.0, 1.0, 5.0]
LENGTHS = [4, 2, 3, 1, 4, 4, 2, 3, 4, 1, 2, 3, 4]
VALID = [True] * 13
VALID[9] = False  # d keeps two valid samples
VALID[12] = False  # e keeps one valid sample -> zero


def ref_group(i: int, scores: list[float] = SCORES) -> list[float]:
    return [scores[j] for j in range(len(UIDS)) if UIDS[j] == UIDS[i] and VALID[j]]


def ref_grpo(norm: bool, eps: float = 1e-6, scores: list[float] = SCORES) -> list[float]:
    out = []
    for i, s in enumerate(scores):
        group = ref_group(i, scores)
        if not VALID[i] or len(group) < 2 or len(set(group)) == 1:
            out.append(0.0)
            continue
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        out.append((s - mean) / (std + eps) if norm else s - mean)
    return out


def run_estimator(name: str, index=None, **kw):
    rewards, mask = outcome_batch(SCORES, LENGTHS)
    return get_adv_estimator(name)(
        token_level_rewards=rewards,
        response_mask=mask,
        valid_mask=torch.tensor(VALID),
        index=np.array(UIDS, dtype=object) if index is None else index,
        **kw,
    )


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference(norm: bool) -> None:
    adv, returns = run_estimator("grpo", config=AlgorithmConfig(norm_adv_by_std_in_grpo=norm))
    expected = broadcast(ref_grpo(norm), LENGTHS)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(returns, adv)
    assert torch.equal(adv[4:8], torch.zeros(4, T))  # all-equal group, singleton group: exact 0
    assert torch.equal(adv[9], torch.zeros(T)) and torch.equal(adv[11:], torch.zeros(2, T))


def ref_gdpo(components: list[list[float]], weights: list[float], norm: bool) -> torch.Tensor:
    """Each reward's GRPO advantage over the test groups, weighted, summed, then whitened over
    the valid rows' response steps."""
    total = [0.0] * len(UIDS)
    for column, weight in zip(components, weights, strict=True):
        advantages = ref_grpo(norm, scores=column)
        total = [t + weight * a for t, a in zip(total, advantages, strict=True)]
    keep = [[VALID[i] and j < n for j in range(T)] for i, n in enumerate(LENGTHS)]
    return torch.tensor(ref_whiten([[t] * T for t in total], keep))


@pytest.mark.parametrize("norm", [True, False])
def test_gdpo_matches_reference(norm: bool) -> None:
    second = [float((7 * i) % 5) * 1e-3 for i in range(len(SCORES))]  # another scale
    weights = [1.0, -2.5]
    adv, returns = run_estimator(
        "gdpo",
        config=AlgorithmConfig(norm_adv_by_std_in_grpo=norm),
        reward_components=torch.tensor([SCORES, second]).T,
        reward_weights=torch.tensor(weights),
    )
    want = ref_gdpo([SCORES, second], weights, norm)
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(returns, adv)
    assert torch.equal(adv[9], torch.zeros(T)) and torch.equal(adv[12], torch.zeros(T))


def test_gdpo_normalises_each_reward_in_its_group() -> None:
    """A reward on a 1e-3 scale orders the samples as much as a 0/1 reward of the same weight;
    in GRPO's sum the 0/1 reward alone decides."""
    fine = [0.001, 0.002, 0.003, 0.004]  # sample 3 best
    coarse = [1.0, 0.0, 1.0, 0.0]  # samples 0 and 2 best
    rewards, mask = outcome_batch([f + c for f, c in zip(fine, coarse, strict=True)], [2] * 4)
    common = dict(
        token_level_rewards=rewards, response_mask=mask, index=np.array(["g"] * 4, dtype=object)
    )
    gdpo, _ = get_adv_estimator("gdpo")(
        **common,
        reward_components=torch.tensor([fine, coarse]).T,
        reward_weights=torch.tensor([1.0, 1.0]),
    )
    grpo, _ = get_adv_estimator("grpo")(**common)
    assert gdpo[3, 0] > gdpo[0, 0]  # the fine reward's best beats the coarse reward's worst
    assert grpo[3, 0] < grpo[0, 0]  # in the sum it does not


def test_grpo_int_tensor_index_matches_strings() -> None:
    ids = torch.tensor([ord(u) for u in UIDS])
    adv_int, _ = run_estimator("grpo", index=ids, config=AlgorithmConfig())
    adv_str, _ = run_estimator("grpo", config=AlgorithmConfig())
    torch.testing.assert_close(adv_int, adv_str)


def test_rloo_matches_reference() -> None:
    expected = []
    for i, s in enumerate(SCORES):
        group = ref_group(i)
        others = list(group)
        if VALID[i]:
            others.remove(s)
        ok = VALID[i] and len(group) >= 2
        expected.append(s - sum(others) / len(others) if ok else 0.0)
    adv, _ = run_estimator("rloo", config=AlgorithmConfig())
    torch.testing.assert_close(adv, broadcast(expected, LENGTHS), atol=1e-5, rtol=1e-5)
    assert torch.equal(adv[4:8], torch.zeros(4, T))


def test_reinforce_plus_plus_baseline_matches_reference() -> None:
    centered = []
    for i, s in enumerate(SCORES):
        group = ref_group(i)
        centered.append(s - sum(group) / len(group) if VALID[i] else 0.0)
    keep = [[VALID[i] and j < n for j in range(T)] for i, n in enumerate(LENGTHS)]
    rows = [[c] * T for c in centered]
    adv, _ = run_estimator("reinforce_plus_plus_baseline", config=AlgorithmConfig())
    torch.testing.assert_close(adv, torch.tensor(ref_whiten(rows, keep)), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- token-level estimators


def token_batch():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 5, generator=gen)
    values = torch.randn(4, 5, generator=gen)
    mask = torch.tensor(
        [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.float32
    )  # row 2 has a masked step mid-response (e.g. a tool output)
    valid = torch.tensor([True, True, True, False])
    return rewards, values, mask, valid


def test_gae_matches_hand_rolled_loop() -> None:
    rewards, values, mask, valid = token_batch()
    gamma, lam = 0.9, 0.8
    raw, ret, keep = [], [], []
    for i in range(4):
        steps = [t for t in range(5) if mask[i, t] > 0]
        adv_row, gae = [0.0] * 5, 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_v = values[i, steps[k + 1]].item() if k + 1 < len(steps) else 0.0
            delta = rewards[i, t].item() + gamma * next_v - values[i, t].item()
            gae = delta + gamma * lam * gae
            adv_row[t] = gae
        raw.append(adv_row)
        ok = bool(valid[i])
        ret.append(
            [a + values[i, t].item() if (ok and t in steps) else 0.0 for t, a in enumerate(adv_row)]
        )
        keep.append([ok and t in steps for t in range(5)])
    adv, returns = get_adv_estimator("gae")(
        token_level_rewards=rewards,
        response_mask=mask,
        valid_mask=valid,
        index=None,
        values=values,
        config=AlgorithmConfig(gamma=gamma, lam=lam),
    )
    torch.testing.assert_close(returns, torch.tensor(ret), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(adv, torch.tensor(ref_whiten(raw, keep)), atol=1e-5, rtol=1e-5)


def test_reinforce_plus_plus_return_to_go() -> None:
    rewards, _, mask, valid = token_batch()
    mask = torch.tensor(
        [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    ).float()
    gamma = 0.9
    rtg, keep = [], []
    for i in range(4):
        n = int(mask[i].sum())
        row, g = [0.0] * 5, 0.0
        for t in reversed(range(n)):
            g = rewards[i, t].item() + gamma * g
            row[t] = g if valid[i] else 0.0
        rtg.append(row)
        keep.append([bool(valid[i]) and t < n for t in range(5)])
    adv, returns = get_adv_estimator("reinforce_plus_plus")(
        token_level_rewards=rewards,
        response_mask=mask,
        valid_mask=valid,
        index=None,
        config=AlgorithmConfig(gamma=gamma),
    )
    torch.testing.assert_close(returns, torch.tensor(rtg), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(adv, torch.tensor(ref_whiten(rtg, keep)), atol=1e-5, rtol=1e-5)


def test_reinforce_plus_plus_carries_the_return_across_observation_steps() -> None:
    # Two turns with an observation step between them; the reward comes at the end.
    rewards = torch.tensor([[0.0, 5.0, 0.0, 1.0]])  # the 5.0 sits on the masked step
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    _, returns = get_adv_estimator("reinforce_plus_plus")(
        token_level_rewards=rewards,
        response_mask=mask,
        index=None,
        config=AlgorithmConfig(gamma=0.5),
    )
    # The masked step is skipped, not discounted, and its reward is ignored.
    torch.testing.assert_close(returns, torch.tensor([[0.25, 0.0, 0.5, 1.0]]))


def test_remax_return_is_undiscounted() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    common = {
        "token_level_rewards": rewards,
        "response_mask": torch.ones(1, 3),
        "index": None,
        "reward_baselines": torch.tensor([0.5]),
    }
    adv, returns = get_adv_estimator("remax")(config=AlgorithmConfig(gamma=0.5), **common)
    # The greedy baseline is an undiscounted sequence score, so the return is too.
    torch.testing.assert_close(returns, torch.ones(1, 3))
    torch.testing.assert_close(adv, torch.full((1, 3), 0.5))


def test_remax() -> None:
    rewards = torch.tensor([[0.5, 0.0, 1.0], [2.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).float()
    baselines = torch.tensor([0.25, 1.0])
    expected_returns = [[1.5, 1.0, 1.0], [3.0, 1.0, 0.0]]
    expected_adv = [[1.25, 0.75, 0.75], [2.0, 0.0, 0.0]]
    adv, returns = get_adv_estimator("remax")(
        token_level_rewards=rewards,
        response_mask=mask,
        index=None,
        reward_baselines=baselines,
        config=AlgorithmConfig(),
    )
    torch.testing.assert_close(returns, torch.tensor(expected_returns))
    torch.testing.assert_close(adv, torch.tensor(expected_adv))


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_estimators_never_nan(name: str) -> None:
    rewards, mask = outcome_batch([1.0, 1.0, 1.0, 1.0], [3, 0, 2, 0])  # constant; two empty rows
    adv, returns = get_adv_estimator(name)(
        token_level_rewards=rewards,
        response_mask=mask,
        valid_mask=torch.tensor([True, True, True, False]),
        index=np.array(["x", "x", "x", "x"], dtype=object),
        values=torch.zeros(4, T),
        reward_baselines=torch.ones(4),
        config=AlgorithmConfig(),
        **(
            {"reward_components": torch.ones(4, 2), "reward_weights": torch.tensor([1.0, -1.0])}
            if ADV_ESTIMATORS.trait(name, "needs_components", False)
            else {}
        ),
    )
    assert torch.isfinite(adv).all() and torch.isfinite(returns).all()
    assert torch.equal(adv[1], torch.zeros(T)) and torch.equal(adv[3], torch.zeros(T))
    if name in ("grpo", "gdpo", "rloo", "reinforce_plus_plus_baseline"):
        assert torch.equal(adv, torch.zeros_like(adv))


def test_missing_inputs_raise() -> None:
    rewards, mask = outcome_batch([1.0, 0.0], [2, 2])
    common = {"token_level_rewards": rewards, "response_mask": mask, "config": AlgorithmConfig()}
    with pytest.raises(ValueError, match="values"):
        get_adv_estimator("gae")(index=None, **common)
    with pytest.raises(ValueError, match="reward_baselines"):
        get_adv_estimator("remax")(index=None, **common)
    with pytest.raises(ValueError, match="index"):
        get_adv_estimator("grpo")(index=None, **common)
    with pytest.raises(ValueError, match="reward_components"):
        get_adv_estimator("gdpo")(index=np.array(["g", "g"], dtype=object), **common)


# --------------------------------------------------------------------------- aggregation


def test_agg_modes_match_reference() -> None:
    loss = torch.tensor(
        [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0], [1.0, 1.0, 1.0, 1.0]]
    )
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]).float()
    valid = torch.tensor([True, True, True, False])
    rows = [[1.0, 2.0, 3.0], [5.0]]  # row 2 fully masked, row 3 invalid
    expected = {
        "token-mean": sum(sum(r) for r in rows) / 4,
        "seq-mean-token-sum": (6.0 + 5.0) / 2,
        "seq-mean-token-mean": (2.0 + 5.0) / 2,
        "seq-mean-token-sum-norm": (6.0 / 4 + 5.0 / 4) / 2,
    }
    for mode, value in expected.items():
        got = agg_loss(loss, mask, mode, valid_mask=valid)
        assert got.item() == pytest.approx(value), mode
    got = agg_loss(loss, mask, "seq-mean-token-sum-norm", valid_mask=valid, norm_constant=8.0)
    assert got.item() == pytest.approx((6.0 / 8 + 5.0 / 8) / 2)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_agg_all_masked_is_zero_with_graph(mode: str) -> None:
    loss = torch.full((2, 3), float("inf"), requires_grad=True)
    out = agg_loss(loss, torch.zeros(2, 3), mode)
    assert out.item() == 0.0 and out.requires_grad
    out.backward()
    assert torch.equal(loss.grad, torch.zeros(2, 3))


# --------------------------------------------------------------------------- policy losses


def test_vanilla_asymmetric_and_dual_clip() -> None:
    ratios = [1.5, 0.5, 1.1, 4.0, 0.5]
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    log_prob = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    cfg = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=3.0)
    loss, metrics = get_policy_loss("vanilla")(
        old_log_prob=torch.zeros(1, 5),
        log_prob=log_prob,
        advantages=adv,
        response_mask=torch.ones(1, 5),
        valid_mask=None,
        config=cfg,
    )
    # per token: -1.3 (clipped high), -0.5, 1.1, 3.0 (dual clip), 0.8 (clipped low)
    assert loss.item() == pytest.approx((-1.3 - 0.5 + 1.1 + 3.0 + 0.8) / 5)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 5)
    assert metrics["ppo_kl"] == pytest.approx(-sum(math.log(r) for r in ratios) / 5, rel=1e-5)
    loss.backward()
    expected_grad = [0.0, -0.5 / 5, 1.1 / 5, 0.0, 0.0]  # d(-A r)/dlogp = -A r, zero where clipped
    torch.testing.assert_close(log_prob.grad, torch.tensor([expected_grad]))


def test_vanilla_without_dual_clip() -> None:
    log_prob = torch.tensor([[math.log(4.0)]])
    loss, metrics = get_policy_loss("vanilla")(
        old_log_prob=torch.zeros(1, 1),
        log_prob=log_prob,
        advantages=torch.tensor([[-1.0]]),
        response_mask=torch.ones(1, 1),
        valid_mask=None,
        config=ActorConfig(clip_ratio_c=None),
    )
    assert loss.item() == pytest.approx(4.0) and metrics["pg_clipfrac_lower"] == 0.0


def test_gspo_sequence_ratio() -> None:
    log_ratio = torch.tensor([[1e-4, -1e-4, 2e-4], [0.01, 0.01, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).float()
    log_prob = torch.full((2, 3), -1.0, requires_grad=True)
    loss, metrics = get_policy_loss("gspo")(
        old_log_prob=-1.0 - log_ratio,
        log_prob=log_prob,
        advantages=torch.ones(2, 3),
        response_mask=mask,
        valid_mask=None,
        config=ActorConfig(),
    )
    s0 = math.exp(sum([1e-4, -1e-4, 2e-4]) / 3)  # inside [1 - 3e-4, 1 + 4e-4]
    s1 = math.exp(0.01)  # above 1 + 4e-4: clipped, no gradient
    assert s1 > 1 + 4e-4
    assert loss.item() == pytest.approx((-s0 - (1 + 4e-4)) / 2, rel=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)
    loss.backward()
    expected_grad = [[-s0 / 6] * 3, [0.0, 0.0, 0.0]]
    torch.testing.assert_close(log_prob.grad, torch.tensor(expected_grad))


def test_cispo_without_bounds_of_its_own_uses_the_actor_clip_ratio() -> None:
    # No CISPO bound chosen: the weight is capped at 1 + actor.clip_ratio_high, not at a
    # constant nobody set; with no lower bound a small ratio keeps its weight.
    log_ratio = torch.tensor([[math.log(3.0), math.log(0.1)]])
    log_prob = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    cfg = ActorConfig(clip_ratio_high=0.28, policy_loss=PolicyLossConfig("cispo"))
    loss, _ = get_policy_loss("cispo")(
        old_log_prob=log_prob.detach() - log_ratio,
        log_prob=log_prob,
        advantages=torch.ones(1, 2),
        response_mask=torch.ones(1, 2),
        config=cfg,
    )
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.28 / 2, -0.1 / 2]]))


def test_cispo_clipped_detached_weight() -> None:
    log_ratio = torch.tensor([[0.0, math.log(2.0), math.log(10.0), 1000.0]])
    log_prob = torch.tensor([[-0.5, -1.0, -2.0, -0.1]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    loss, metrics = get_policy_loss("cispo")(
        old_log_prob=log_prob.detach() - log_ratio,
        log_prob=log_prob,
        advantages=adv,
        response_mask=torch.ones(1, 4),
        valid_mask=None,
        config=ActorConfig(policy_loss=PolicyLossConfig("cispo", cispo_clip_ratio_high=4.0)),
    )
    weights, a, lp = [1.0, 2.0, 5.0, 5.0], [1.0, -1.0, 1.0, 1.0], [-0.5, -1.0, -2.0, -0.1]
    ref = sum(-w * x * p for w, x, p in zip(weights, a, lp, strict=True)) / 4
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 4)
    loss.backward()
    expected = [-w * x / 4 for w, x in zip(weights, a, strict=True)]
    torch.testing.assert_close(log_prob.grad, torch.tensor([expected]))


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("delta", [1000.0, -1000.0])
def test_overflowing_ratio_is_finite(name: str, delta: float) -> None:
    log_prob = torch.full((2, 3), -1.0, requires_grad=True)
    loss, metrics = get_policy_loss(name)(
        old_log_prob=log_prob.detach() - delta,
        log_prob=log_prob,
        advantages=torch.tensor([[1.0, -1.0, 2.0], [-1.0, 1.0, 0.5]]),
        response_mask=torch.ones(2, 3),
        valid_mask=None,
        config=ActorConfig(),
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_prob.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo"])
def test_masked_and_invalid_rows_are_dropped(name: str) -> None:
    gen = torch.Generator().manual_seed(1)
    old, new, adv = (torch.randn(4, 3, generator=gen) * 0.1 for _ in range(3))
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0], [1, 1, 1]]).float()
    valid = torch.tensor([True, True, True, False])
    fn, cfg = get_policy_loss(name), ActorConfig()
    old[3] = new[3] + 1e4  # garbage in an invalid row must not leak
    full, _ = fn(
        old_log_prob=old,
        log_prob=new,
        advantages=adv,
        response_mask=mask,
        valid_mask=valid,
        config=cfg,
    )
    keep = [0, 2]
    sub, _ = fn(
        old_log_prob=old[keep], log_prob=new[keep], advantages=adv[keep],
        response_mask=mask[keep], valid_mask=None, config=cfg,
    )  # fmt: skip
    torch.testing.assert_close(full, sub)
    log_prob = new.clone().requires_grad_(True)
    none, metrics = fn(
        old_log_prob=old, log_prob=log_prob, advantages=adv,
        response_mask=torch.zeros(4, 3), valid_mask=valid, config=cfg,
    )  # fmt: skip
    none.backward()
    assert none.item() == 0.0 and torch.equal(log_prob.grad, torch.zeros(4, 3))
    assert all(v == 0.0 for v in metrics.values())


# --------------------------------------------------------------------------- KL


def test_kl_kinds() -> None:
    logp, ref = [-1.0, -0.2, -3.0, -0.5], [-1.5, -0.2, -0.1, -30.0]
    lp, rp = torch.tensor([logp]), torch.tensor([ref])
    k1 = [a - b for a, b in zip(logp, ref, strict=True)]
    k3 = [
        min(max(math.exp(b - a) - (b - a) - 1, -10.0), 10.0) for a, b in zip(logp, ref, strict=True)
    ]
    expected = {
        "k1": k1,
        "kl": k1,
        "abs": [abs(x) for x in k1],
        "k2": [0.5 * x * x for x in k1],
        "mse": [0.5 * x * x for x in k1],
        "k3": k3,
        "low_var_kl": k3,
    }
    for kind, values in expected.items():
        torch.testing.assert_close(kl_penalty(lp, rp, kind), torch.tensor([values]), msg=kind)
    assert k3[2] == 10.0  # the clamp is exercised


def test_adaptive_kl_controller_direction() -> None:
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    ctrl.update(current_kl=0.5, n_steps=10)  # far above target: error clipped to +0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    before = ctrl.value
    ctrl.update(current_kl=0.04, n_steps=10)  # below target: error -0.2
    assert ctrl.value == pytest.approx(before * (1 - 0.2 * 10 / 100))
    fixed = FixedKLController(kl_coef=0.3)
    fixed.update(current_kl=10.0, n_steps=10)
    assert fixed.value == 0.3


def test_apply_kl_penalty() -> None:
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    logp = torch.tensor([[-1.0, -1.0, -9.0], [-1.0, -2.0, -1.0]])
    ref = torch.tensor([[-1.5, -0.5, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).float()
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=1.0, horizon=10)
    rewards, metrics = apply_kl_penalty(scores, logp, ref, mask, ctrl, kind="k1")
    kl = [[0.5, -0.5, 0.0], [0.0, -1.0, 0.0]]
    expected = [
        [s - 0.2 * k for s, k in zip(sr, kr, strict=True)]
        for sr, kr in zip(scores.tolist(), kl, strict=True)
    ]
    torch.testing.assert_close(rewards, torch.tensor(expected))
    batch_kl = (0.0 / 2 + -1.0 / 3) / 2
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(batch_kl)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.2)
    assert ctrl.value == pytest.approx(0.2 * (1 - 0.2 * 2 / 10))


def test_apply_kl_penalty_statistic_skips_invalid_and_empty_rows() -> None:
    """The batch KL (logged, and what an adaptive controller steers by) averages the per-row
    token means of valid rows that have response tokens; a one-token row counts."""
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-3.0, -3.0], [-2.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.5], [-2.0, -2.0], [-1.0, -1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]]).float()
    valid = torch.tensor([True, True, False, True])
    ctrl = FixedKLController(0.1)
    _, metrics = apply_kl_penalty(
        torch.zeros(4, 2), logp, ref, mask, ctrl, kind="k1", valid_mask=valid
    )
    # row 0: mean(0.5, -0.5) = 0; row 1: 1.0 (one token); row 2 invalid; row 3 no tokens.
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)


# --------------------------------------------------------------------------- value loss, entropy


def test_value_loss_clipping() -> None:
    vpreds = torch.tensor([[0.5, 0.1, -0.5, 9.0]], requires_grad=True)
    values = torch.zeros(1, 4)
    returns = torch.tensor([[1.0, 1.0, -1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]]).float()
    loss, metrics = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    # clipped preds 0.2, 0.1, -0.2 -> max errors 0.64, 0.81, 0.64
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 0.64) / 3)
    assert metrics["vf_clipfrac"] == pytest.approx(2 / 3)
    loss.backward()
    torch.testing.assert_close(
        vpreds.grad, torch.tensor([[0.0, 0.5 * 2 * (0.1 - 1.0) / 3, 0.0, 0.0]])
    )


def test_value_loss_leaves_invalid_rows_out() -> None:
    """An invalid sample (its verifier failed) adds nothing to the value loss, its gradient
    or its clip fraction."""
    vpreds = torch.tensor([[0.5, 0.1], [3.0, 3.0]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    valid = torch.tensor([True, False])
    loss, metrics = compute_value_loss(
        vpreds, returns, torch.zeros(2, 2), mask, cliprange_value=10.0, valid_mask=valid
    )
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.81) / 2)
    assert metrics["vf_clipfrac"] == 0.0
    loss.backward()
    assert torch.equal(vpreds.grad[1], torch.zeros(2))


def test_entropy_matches_categorical() -> None:
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(2)) * 10
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- registries and config


def test_unknown_names_list_known_ones() -> None:
    with pytest.raises(ValueError, match="grpo.*rloo|rloo.*grpo"):
        get_adv_estimator("ppo_magic")
    with pytest.raises(ValueError, match="vanilla"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "mean")
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_registry_names_and_duplicates() -> None:
    assert set(ADV_ESTIMATORS) >= {
        "grpo", "gdpo", "gae", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
        "remax",
    }  # fmt: skip
    with pytest.raises(ValueError, match="already registered"):
        register_adv_estimator("grpo")(lambda **kw: kw)


def test_rollout_is_weights_token_and_sequence_levels() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]])
    rollout = torch.tensor([[-1.5, -1.0, -0.5], [-3.0, -1.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights, metrics = rollout_is_weights(old, rollout, mask, "token", cap=2.0)
    expected = torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0], [2.0, math.exp(0.2), 1.0]])
    assert torch.allclose(weights, expected)  # e^2 capped at 2; the padded step stays 1
    assert metrics["rollout_is/capped_frac"] == pytest.approx(1 / 5)
    seq, _ = rollout_is_weights(old, rollout, mask, "sequence", cap=10.0)
    assert torch.allclose(seq[0], torch.full((3,), math.exp(-0.5)))
    assert torch.allclose(seq[1], torch.tensor([math.exp(2.2), math.exp(2.2), 1.0]))
    # A huge gap is capped without overflowing to inf.
    far, _ = rollout_is_weights(
        torch.zeros(1, 2), torch.full((1, 2), -1e4), torch.ones(1, 2), "sequence", 3.0
    )
    assert torch.equal(far, torch.full((1, 2), 3.0))
    with pytest.raises(ValueError, match="rollout_is='tokens'"):
        rollout_is_weights(old, rollout, mask, "tokens")


def test_rollout_is_weights_scale_the_vanilla_loss_per_token() -> None:
    g = torch.Generator().manual_seed(0)
    old, new, adv = (torch.randn(3, 5, generator=g) for _ in range(3))
    mask, valid = torch.ones(3, 5), torch.ones(3, dtype=torch.bool)
    weights = torch.rand(3, 5, generator=g) * 2
    cfg = ActorConfig(loss_agg_mode="token-mean")
    loss_fn = get_policy_loss("vanilla")
    weighted, _ = loss_fn(
        old_log_prob=old,
        log_prob=new,
        advantages=adv * weights,
        response_mask=mask,
        valid_mask=valid,
        config=cfg,
    )
    # Reference: each token's clipped PPO term times its weight, averaged over tokens.
    ratio = (new - old).exp()
    per_token = torch.maximum(
        -adv * ratio, -adv * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    )
    dual = torch.minimum(per_token, -adv * cfg.clip_ratio_c)
    per_token = torch.where(adv < 0, dual, per_token)
    assert weighted.item() == pytest.approx((per_token * weights).mean().item(), rel=1e-5)
