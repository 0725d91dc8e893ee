"""mmrl's algorithm core against golden values computed by verl's own core_algos.

tests/data/verl_golden.json holds seeded float64 inputs and what verl returned on them
(scripts/verl_golden/make_golden.py; the verl version and the command are in the file).
mmrl must return the same numbers. The conventions in which mmrl deliberately differs
from verl (docs/algorithms.md, "Differences from verl") are tested here as differences:
mmrl's value against verl's value, with the reason.

mmrl's functions are reached through its registries, so that the test follows a
function wherever it moves.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl import algos
from mmrl.config import ActorConfig, AlgorithmConfig, PolicyLossConfig

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "data" / "verl_golden.json").read_text())
# Both sides compute in float64. The absolute tolerance covers verl's numerical guards:
# ``masked_mean`` divides by ``count + 1e-8``, and a group of equal scores divides its
# rounding residue (~1e-16) by ``std + 1e-6``, which gives ~1e-10 where mmrl gives 0.
RTOL, ATOL = 1e-6, 1e-9
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
ADV_CASES = {case["id"]: case for case in GOLDEN["advantages"]}


def f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def assert_close(got: torch.Tensor, expected, what: str) -> None:
    torch.testing.assert_close(
        got, f64(expected) if not isinstance(expected, torch.Tensor) else expected,
        rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}",
    )  # fmt: skip


def lone_rows(case: dict) -> torch.Tensor:
    """Bool [B]: samples that are the only member of their group."""
    index = case["inputs"].get("index")
    if index is None:
        return torch.zeros(len(case["inputs"]["response_mask"]), dtype=torch.bool)
    return torch.tensor([index.count(uid) == 1 for uid in index])


def run_estimator(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, cfg = case["inputs"], case["config"]
    optional = {key: f64(inputs[key]) for key in ("values", "reward_baselines") if key in inputs}
    return algos.get_adv_estimator(case["estimator"])(
        token_level_rewards=f64(inputs["token_level_rewards"]),
        response_mask=f64(inputs["response_mask"]),
        index=np.array(inputs["index"], dtype=object) if "index" in inputs else None,
        config=AlgorithmConfig(
            gamma=cfg.get("gamma", 1.0),
            lam=cfg.get("lam", 1.0),
            norm_adv_by_std_in_grpo=cfg.get("norm_adv_by_std_in_grpo", True),
        ),
        **optional,
    )


# --------------------------------------------------------------------------- advantages


def test_golden_file_covers_every_estimator_and_records_its_source():
    assert GOLDEN["versions"]["verl"] == "0.9.1" and "make_golden.py" in GOLDEN["command"]
    estimators = {case["estimator"] for case in GOLDEN["advantages"]}
    assert estimators == {
        "grpo", "rloo", "gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
    }  # fmt: skip
    assert estimators <= set(algos.ADV_ESTIMATORS)
    norms = {c["config"].get("norm_adv_by_std_in_grpo") for c in GOLDEN["advantages"]}
    assert {True, False} <= norms  # GRPO and Dr.GRPO


MATCHING = [
    case
    for case in GOLDEN["advantages"]
    if not (case["estimator"] in GROUP_ESTIMATORS and lone_rows(case).any())
]


@pytest.mark.parametrize("case", MATCHING, ids=[case["id"] for case in MATCHING])
def test_advantages_match_verl(case: dict):
    adv, returns = run_estimator(case)
    # Masked steps are compared in test_masked_steps_hold_zero (a convention).
    keep = f64(case["inputs"]["response_mask"]).bool()
    assert_close(adv[keep], f64(case["advantages"])[keep], f"{case['id']} advantages")
    assert_close(returns[keep], f64(case["returns"])[keep], f"{case['id']} returns")


@pytest.mark.parametrize("estimator_id", [
    "grpo/groups_with_singletons/norm_adv_by_std_in_grpo=True",
    "grpo/groups_with_singletons/norm_adv_by_std_in_grpo=False",
    "rloo/groups_with_singletons",
    "reinforce_plus_plus_baseline/groups_with_singletons",
])  # fmt: skip
def test_lone_sample_gets_no_advantage_where_verl_gives_its_raw_score(estimator_id: str):
    """Convention: a group with one valid sample gets advantage 0.

    A lone sample has nothing to be compared with. verl centres it on 0 instead of on
    its own score, so its advantage is its raw score (divided by ``1 + eps`` in GRPO):
    an update that raises or lowers the response by the absolute reward level, at full
    weight, while every other sample is scaled by its group's spread. mmrl gives it 0,
    which is its score minus its group's mean. In mmrl a group shrinks to one sample
    whenever verifiers fail on the others (``valid_mask``), so this case is common.
    REINFORCE++-baseline shares the rule; there the lone sample's raw score also shifts
    the batch whitening, so every row differs.
    """
    case = ADV_CASES[estimator_id]
    lone = lone_rows(case)
    mask = f64(case["inputs"]["response_mask"])
    scores = (f64(case["inputs"]["token_level_rewards"]) * mask).sum(-1)
    adv, _ = run_estimator(case)
    verl_adv = f64(case["advantages"])
    assert lone.any() and (scores[lone] != 0).all()
    if case["estimator"] != "reinforce_plus_plus_baseline":
        assert torch.equal(adv[lone], torch.zeros_like(adv[lone]))
        eps = 1e-6 if case["config"].get("norm_adv_by_std_in_grpo") else 0.0
        raw = scores[lone, None] / (1 + eps) * mask[lone]
        assert_close(verl_adv[lone], raw, "verl: a lone sample's advantage is its raw score")
        keep = mask.bool() & ~lone[:, None]
        assert_close(adv[keep], verl_adv[keep], "samples in groups of two or more")
    else:
        assert not torch.allclose(adv[lone], verl_adv[lone])
    # The whole difference: mmrl on this batch is verl on it with the lone scores set to 0.
    zeroed = ADV_CASES[estimator_id.replace("singletons", "singletons_lone_scores_zeroed")]
    keep = mask.bool()
    assert_close(adv[keep], f64(zeroed["advantages"])[keep], "verl with lone scores at 0")


@pytest.mark.parametrize("case", GOLDEN["advantages"], ids=[c["id"] for c in GOLDEN["advantages"]])
def test_masked_steps_hold_zero(case: dict):
    """Convention: every estimator leaves 0 in advantages and returns on masked steps.

    verl's GAE whitens the whole tensor and returns the whitening shift ``-mean/std`` on
    padding and observation steps, and its returns there are the carried advantage plus
    the value; its ReMax returns the carried return-to-go on observation steps. No loss
    reads them (every loss is masked), but anything that reads the tensor whole (a
    metric, a sum, a later estimator) would. mmrl writes 0 there, as verl's other
    estimators already do.
    """
    adv, returns = run_estimator(case)
    masked = ~f64(case["inputs"]["response_mask"]).bool()
    assert masked.any()
    assert torch.equal(adv[masked], torch.zeros_like(adv[masked]))
    assert torch.equal(returns[masked], torch.zeros_like(returns[masked]))
    if case["estimator"] == "gae":  # verl's values there: the documented difference
        mask = f64(case["inputs"]["response_mask"])
        after_end = mask.flip(-1).cumsum(-1).flip(-1) == 0  # right padding
        shift = f64(case["advantages"])[after_end]
        assert shift.abs().min() > 0 and torch.allclose(shift, shift[0].expand_as(shift))


# --------------------------------------------------------------------------- losses


def test_agg_loss_matches_verl():
    group = GOLDEN["agg_loss"][0]
    loss_mat, mask = f64(group["loss_mat"]), f64(group["loss_mask"])
    assert (mask.sum(-1) == 0).any()  # a fully masked row, which the seq modes leave out
    modes = {case["mode"] for case in group["cases"]}
    assert modes == set(algos.AGG_MODES)
    for case in group["cases"]:
        got = algos.agg_loss(loss_mat, mask, case["mode"], norm_constant=case["norm_constant"])
        assert_close(got, case["loss"], case["id"])


def policy_loss_config(loss_mode: str, cfg: dict) -> ActorConfig:
    """mmrl's actor config for verl's actor clip settings (verl's GSPO/CISPO read the actor's
    clip ratios; mmrl's GSPO has its own, and CISPO falls back to the actor's upper one)."""
    low, high, agg = cfg["low"], cfg["high"], cfg["loss_agg_mode"]
    if loss_mode == "gspo":
        knobs = PolicyLossConfig(
            "gspo", gspo_clip_ratio_low=low, gspo_clip_ratio_high=high, gspo_loss_agg_mode=agg
        )
        return ActorConfig(loss_agg_mode=agg, policy_loss=knobs)
    if loss_mode == "cispo":
        # verl's lower bound 1 - low is 0 for low = 1: no lower bound, mmrl's None.
        knobs = PolicyLossConfig("cispo", cispo_clip_ratio_low=None if low == 1.0 else low)
        return ActorConfig(clip_ratio_high=high, loss_agg_mode=agg, policy_loss=knobs)
    return ActorConfig(
        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=cfg["c"], loss_agg_mode=agg
    )


POLICY = GOLDEN["policy_loss"][0]


@pytest.mark.parametrize("case", POLICY["cases"], ids=[c["id"] for c in POLICY["cases"]])
def test_policy_loss_matches_verl(case: dict):
    inputs = {key: f64(value) for key, value in POLICY["inputs"][case["inputs"]].items()}
    log_prob = inputs["log_prob"].clone().requires_grad_(True)
    advantages = inputs["advantages"]
    if case["rollout_is_weights"] is not None:
        # verl multiplies the clipped per-token loss by the weights; mmrl's actor scales the
        # advantages by them (hybrid/actor.py), the same for weights > 0.
        advantages = advantages * f64(case["rollout_is_weights"])
    loss, metrics = algos.get_policy_loss(case["loss_mode"])(
        old_log_prob=inputs["old_log_prob"],
        log_prob=log_prob,
        advantages=advantages,
        response_mask=inputs["response_mask"],
        config=policy_loss_config(case["loss_mode"], case["config"]),
    )
    loss.backward()
    assert_close(loss.detach(), case["loss"], "loss")
    assert_close(log_prob.grad, case["grad_log_prob"], "d loss / d log_prob")
    for key, expected in case["metrics"].items():
        # mmrl's clip fractions are float32 means; rounding is ~1e-8.
        assert metrics[key] == pytest.approx(expected, rel=1e-6, abs=1e-7), key


def test_policy_cases_hit_every_clip_region():
    vanilla = [c for c in POLICY["cases"] if c["loss_mode"] == "vanilla"]
    assert {c["config"]["loss_agg_mode"] for c in vanilla} == set(algos.AGG_MODES)
    assert all(0 < c["metrics"]["pg_clipfrac"] < 1 for c in vanilla)
    assert any(c["metrics"]["pg_clipfrac_lower"] > 0 for c in vanilla)  # dual clip
    gspo = [c for c in POLICY["cases"] if c["loss_mode"] == "gspo" and c["inputs"] == "gspo"]
    assert all(0 < c["metrics"]["pg_clipfrac"] < 1 for c in gspo)
    inputs = {key: f64(value) for key, value in POLICY["inputs"]["ppo"].items()}
    ratio = (inputs["log_prob"] - inputs["old_log_prob"]).exp()[inputs["response_mask"].bool()]
    assert ratio.min() < 0.8 and ratio.max() > 3.0  # below 1 - low, above 1 + high and c


def test_value_loss_matches_verl():
    group = GOLDEN["value_loss"][0]
    inputs = {key: f64(value) for key, value in group["inputs"].items()}
    for case in group["cases"]:
        vpreds = inputs["vpreds"].clone().requires_grad_(True)
        loss, metrics = algos.compute_value_loss(
            vpreds,
            inputs["returns"],
            inputs["values"],
            inputs["response_mask"],
            case["cliprange_value"],
            case["loss_agg_mode"],
        )
        loss.backward()
        assert_close(loss.detach(), case["loss"], f"{case['id']} loss")
        assert_close(vpreds.grad, case["grad_vpreds"], f"{case['id']} d loss / d vpreds")
        assert metrics["vf_clipfrac"] == pytest.approx(case["vf_clipfrac"], rel=1e-6, abs=1e-7)
        assert 0 < case["vf_clipfrac"] < 1


# --------------------------------------------------------------------------- KL, IS, stats


def test_kl_estimators_match_verl_including_clamps():
    group = GOLDEN["kl"][0]
    ref = f64(group["inputs"]["ref_log_prob"])
    for case in group["cases"]:
        log_prob = f64(group["inputs"]["log_prob"]).requires_grad_(True)
        kl = algos.kl_penalty(log_prob, ref, case["kind"])
        kl.sum().backward()
        assert_close(kl.detach(), case["kl"], case["kind"])
        assert_close(log_prob.grad, case["grad_log_prob"], f"{case['kind']} gradient")
    low_var = f64(next(c["kl"] for c in group["cases"] if c["kind"] == "k3"))
    assert (low_var == 10.0).any()  # verl's clamp of the estimate was reached


def test_adaptive_kl_controller_matches_verl():
    spec = GOLDEN["kl"][0]["adaptive_controller"]
    ctrl = algos.AdaptiveKLController(spec["init_kl_coef"], spec["target_kl"], spec["horizon"])
    for (current_kl, n_steps), expected in zip(spec["updates"], spec["values"], strict=True):
        ctrl.update(current_kl=current_kl, n_steps=n_steps)
        assert ctrl.value == pytest.approx(expected, rel=1e-12)


def test_rollout_is_weights_match_verl():
    group = GOLDEN["rollout_is"][0]
    inputs = {key: f64(value) for key, value in group["inputs"].items()}
    keep = inputs["response_mask"].bool()
    assert any((f64(case["weights"])[keep] == case["cap"]).any() for case in group["cases"])
    for case in group["cases"]:
        weights, metrics = algos.rollout_is_weights(
            inputs["old_log_probs"],
            inputs["rollout_log_probs"],
            inputs["response_mask"],
            case["level"],
            case["cap"],
        )
        # Off the mask verl writes 0 and mmrl 1; neither is read (the loss is masked).
        assert_close(weights[keep], f64(case["weights"])[keep], case["id"])
        assert metrics["rollout_is/mean"] == pytest.approx(case["mean"], rel=1e-6)


def test_masked_statistics_and_entropy_match_verl():
    stats = GOLDEN["stats"]
    values, mask = f64(stats["values"]), f64(stats["mask"])
    keep = mask.bool()
    assert_close(algos.masked_mean(values, mask), stats["masked_mean"], "masked_mean")
    assert_close(algos.masked_mean(values, mask, dim=-1), stats["masked_mean_rows"], "rows")
    assert_close(algos.masked_var(values, mask), stats["masked_var"], "masked_var")
    for shift_mean, key in ((True, "masked_whiten"), (False, "masked_whiten_keep_mean")):
        whitened = algos.masked_whiten(values, mask, shift_mean=shift_mean)
        assert_close(whitened[keep], f64(stats[key])[keep], key)
        # mmrl's convention: 0 off the mask (verl keeps the whitened value there).
        assert torch.equal(whitened[~keep], torch.zeros_like(whitened[~keep]))
    entropy = algos.entropy_from_logits(f64(stats["logits"]))
    assert_close(entropy, stats["entropy"], "entropy_from_logits")
