"""Every algorithm setting of the fit step changes the batch as its formula says.

The fit step's experience stage (:func:`mmrl.trainer.experience.make_experience`: generate, score,
log-probs, KL reward, importance weights, advantages) runs on the warmed-up addition model
with real workers, a real critic and the real verifier. Generation is seeded and no update
happens between calls, so every setting sees the same responses. Each result is checked
against a formula written out here, from the batch's own scores, log-probs and values,
without mmrl.algos: a registry that hands back the wrong estimator fails.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from mmrl.algos import ADV_ESTIMATORS, KL_PENALTIES, build_kl_controller
from mmrl.config import load_config
from mmrl.errors import ConfigError
from mmrl.hybrid import build_workers
from mmrl.protocol import Batch
from mmrl.tasks import get_task
from mmrl.trainer.experience import make_experience, sampling_params, score, step_seed
from mmrl.trainer.fit import fit
from mmrl.verifiers import VerifierOutput, VerifierRunner, register_verifier
from tests.conftest import run_overrides

N = 8  # samples per prompt (with 4, every group agreed on an AMX Xeon and showed nothing)


@register_verifier("test_fewer_characters")
def fewer_characters(batch: Batch) -> VerifierOutput:
    """Characters in the response, a reward on another scale than exact_answer's 0/1."""
    lengths = np.array([len(str(r)) for r in batch["response_text"]], dtype=float)
    return VerifierOutput(scores=lengths, valid=np.ones(len(lengths), dtype=bool))


@pytest.fixture(scope="module")
def rig(tmp_path_factory, warm_model_dir):
    """Workers (actor, reference, critic), processor, verifier and one step's prompts.

    The actor takes one update first, so that it differs from the reference and the KL
    terms are not zero.
    """
    out = tmp_path_factory.mktemp("effects")
    cfg = load_config(
        run_overrides(
            out,
            f"actor_rollout_ref.model.path={warm_model_dir}",
            f"actor_rollout_ref.rollout.n={N}",
            "actor_rollout_ref.actor.lr=1e-3",
            # Hot sampling: some answers in a group are wrong, so advantages are not all zero.
            "actor_rollout_ref.rollout.temperature=2.0",
            "data.train_batch_size=6",
        )
    )
    task = get_task(cfg.task["name"])(cfg.task)
    processor = task.build_prompt_processor(warm_model_dir, cfg)
    train = task.build_data(cfg.trainer.seed).train
    # Four two-digit answers and two one-digit ones: with 2 response tokens the first are cut
    # before their end-of-sequence token and the others are not (the overlong test).
    digits = [len(str(t)) for t in train.ground_truth]
    rows = [i for i, d in enumerate(digits) if d == 2][:4]
    rows += [i for i, d in enumerate(digits) if d == 1][:2]
    prompts = processor.encode_dataset(train, "train")[torch.tensor(rows)]
    runner = VerifierRunner.from_config(cfg.reward)
    with build_workers(cfg, warm_model_dir, need_ref=True, need_critic=True) as workers:
        rig = dict(cfg=cfg, prompts=prompts, workers=workers, processor=processor, runner=runner)
        first = collect(rig)
        workers.actor.update_actor(first, seed=0)
        yield rig
    runner.close()


def collect(rig, critic: bool = False, metrics: dict | None = None, **settings) -> Batch:
    """One step's experience with ``settings`` (dotted paths under the run config)."""
    cfg = copy.deepcopy(rig["cfg"])
    for path, value in settings.items():
        *parents, leaf = path.split("__")
        node = cfg
        for p in parents:
            node = getattr(node, p)
        setattr(node, leaf, value)
    workers = rig["workers"]
    return make_experience(
        cfg,
        1,
        rig["prompts"].clone(),
        workers.actor,
        workers.critic if critic else None,
        rig["processor"],
        build_kl_controller(cfg.algorithm.kl_ctrl),
        rig["runner"],
        {} if metrics is None else metrics,
    )


# --- the formulas, by hand ----------------------------------------------------------------


def outcome(batch: Batch) -> list[float]:
    return [float(r.sum()) for r in batch["token_level_rewards"] * batch["response_mask"]]


def groups(batch: Batch) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, uid in enumerate(batch["uid"]):
        if batch["valid_mask"][i] and batch["response_mask"][i].any():
            out.setdefault(uid, []).append(i)
    return out


def per_sample(batch: Batch, values: dict[int, float]) -> torch.Tensor:
    adv = torch.zeros_like(batch["response_mask"])
    for i, v in values.items():
        adv[i] = v * batch["response_mask"][i]
    return adv


def hand_grpo(batch: Batch) -> torch.Tensor:
    s, values = outcome(batch), {}
    for rows in groups(batch).values():
        g = np.array([s[i] for i in rows])
        for i in rows:
            values[i] = 0.0 if np.ptp(g) == 0 else (s[i] - g.mean()) / (g.std(ddof=1) + 1e-6)
    return per_sample(batch, values)


def hand_rloo(batch: Batch) -> torch.Tensor:
    s, values = outcome(batch), {}
    for rows in groups(batch).values():
        for i in rows:
            others = [s[j] for j in rows if j != i]
            same = max(s[j] for j in rows) == min(s[j] for j in rows)
            values[i] = 0.0 if same else s[i] - float(np.mean(others))
    return per_sample(batch, values)


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    on = x[mask.bool()].double()
    out = (x.double() - on.mean()) / torch.sqrt(on.var(unbiased=True) + 1e-8)
    return (out * mask).float()


def returns_to_go(batch: Batch, gamma: float) -> torch.Tensor:
    r, m = batch["token_level_rewards"], batch["response_mask"]
    out = torch.zeros_like(r)
    for i in range(len(batch)):
        running = 0.0
        for t in reversed(range(r.shape[1])):
            if m[i, t]:
                running = float(r[i, t]) + gamma * running
                out[i, t] = running
    return out


def hand_reinforce_plus_plus(batch: Batch, gamma: float) -> torch.Tensor:
    return whiten(returns_to_go(batch, gamma), batch["response_mask"])


def hand_reinforce_plus_plus_baseline(batch: Batch) -> torch.Tensor:
    s, values = outcome(batch), {}
    for rows in groups(batch).values():
        g = np.array([s[i] for i in rows])
        for i in rows:
            values[i] = 0.0 if np.ptp(g) == 0 else s[i] - g.mean()
    return whiten(per_sample(batch, values), batch["response_mask"])


def hand_gae(batch: Batch, gamma: float, lam: float) -> torch.Tensor:
    r, v, m = batch["token_level_rewards"], batch["values"], batch["response_mask"]
    adv = torch.zeros_like(r)
    for i in range(len(batch)):
        steps = [t for t in range(r.shape[1]) if m[i, t]]
        next_value, running = 0.0, 0.0
        for t in reversed(steps):
            delta = float(r[i, t]) + gamma * next_value - float(v[i, t])
            running = delta + gamma * lam * running
            adv[i, t], next_value = running, float(v[i, t])
    return whiten(adv, m)


def hand_kl(kind: str, logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    d = (logp - ref).double()
    if kind in ("k1", "kl"):
        return d.float()
    if kind == "abs":
        return d.abs().float()
    if kind in ("k2", "mse"):
        return (0.5 * d**2).float()
    # k3 / low_var_kl, clamped to [-10, 10] as documented (verl's bound)
    return (torch.exp(-d) + d - 1).clamp(-10.0, 10.0).float()


# --- the tests ----------------------------------------------------------------------------


def test_every_estimator_has_a_hand_written_expectation():
    assert set(ADV_ESTIMATORS) == {
        "grpo",
        "gdpo",
        "rloo",
        "gae",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
    }


def test_grpo_and_rloo_advantages_follow_their_formulas(rig):
    grpo = collect(rig, algorithm__adv_estimator="grpo")
    rloo = collect(rig, algorithm__adv_estimator="rloo")
    assert torch.equal(grpo["responses"], rloo["responses"])  # the same samples
    torch.testing.assert_close(grpo["advantages"], hand_grpo(grpo), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rloo["advantages"], hand_rloo(rloo), atol=1e-5, rtol=1e-5)
    # Some groups must disagree, or both are all zeros and the test shows nothing.
    assert grpo["advantages"].abs().max() > 0.1
    # On the same scores, RLOO = n / (n - 1) * (s - mean) and GRPO = (s - mean) / (std + eps).
    assert not torch.allclose(grpo["advantages"], rloo["advantages"])
    dr = collect(rig, algorithm__adv_estimator="grpo", algorithm__norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(rloo["advantages"], dr["advantages"] * N / (N - 1))


def test_gdpo_normalises_each_verifier_in_its_group(rig):
    """Two verifiers: gdpo whitens the weighted sum of each one's GRPO advantage, computed here
    from each verifier alone; GRPO on the same samples normalises their weighted sum."""
    weights = {"exact_answer": 1.0, "test_fewer_characters": -0.01}
    two = VerifierRunner(list(weights.items()))
    try:
        both = {**rig, "runner": two}
        gdpo = collect(both, algorithm__adv_estimator="gdpo")
        grpo = collect(both, algorithm__adv_estimator="grpo")
        assert torch.equal(gdpo["responses"], grpo["responses"])
        want = torch.zeros_like(gdpo["advantages"])
        for name, weight in weights.items():
            alone = VerifierRunner([(name, 1.0)])
            scored, _ = score(gdpo.clone(), rig["processor"], rig["cfg"], alone)
            alone.close()
            scored["token_level_rewards"] = scored["token_level_scores"]
            want += weight * hand_grpo(scored)
        want = whiten(want, gdpo["response_mask"] * gdpo["valid_mask"][:, None])
    finally:
        two.close()
    torch.testing.assert_close(gdpo["advantages"], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grpo["advantages"], hand_grpo(grpo), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(gdpo["advantages"], grpo["advantages"], atol=1e-3)


def test_gdpo_refuses_a_kl_penalty_in_the_reward(tmp_path):
    cfg = load_config(
        run_overrides(tmp_path, "algorithm.adv_estimator=gdpo", "algorithm.use_kl_in_reward=true")
    )
    with pytest.raises(ConfigError, match="use_kl_in_reward=false"):
        fit(cfg)


def test_reinforce_plus_plus_discounts_and_whitens(rig):
    plain = collect(rig, algorithm__adv_estimator="reinforce_plus_plus", algorithm__gamma=0.7)
    want = hand_reinforce_plus_plus(plain, 0.7)
    torch.testing.assert_close(plain["advantages"], want, atol=1e-5, rtol=1e-4)
    base = collect(rig, algorithm__adv_estimator="reinforce_plus_plus_baseline")
    want = hand_reinforce_plus_plus_baseline(base)
    torch.testing.assert_close(base["advantages"], want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(plain["advantages"], base["advantages"])


def test_remax_subtracts_the_greedy_score(rig):
    batch = collect(rig, algorithm__adv_estimator="remax")
    # The greedy answer to each prompt, scored by the same verifier.
    cfg, worker = rig["cfg"], rig["workers"].actor
    params = sampling_params(cfg, rig["processor"], step_seed(cfg, 1), greedy=True)
    greedy = worker.generate_sequences(rig["prompts"].clone(), params)
    greedy, _ = score(greedy, rig["processor"], cfg, rig["runner"])
    baseline = greedy["token_level_scores"].sum(-1).repeat_interleave(N)
    want = returns_to_go(batch, 1.0) - baseline[:, None] * batch["response_mask"]
    torch.testing.assert_close(batch["advantages"], want)


def test_gae_uses_the_critic_values(rig):
    batch = collect(rig, critic=True, algorithm__adv_estimator="gae", algorithm__lam=0.9)
    assert batch["values"].abs().max() > 0  # a critic head that outputs zeros tests nothing
    want = hand_gae(batch, gamma=1.0, lam=0.9)
    torch.testing.assert_close(batch["advantages"], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", sorted(KL_PENALTIES))
def test_kl_in_reward_lowers_rewards_by_coef_times_kl(rig, kind):
    coef, metrics = 0.37, {}
    batch = collect(
        rig,
        metrics=metrics,
        algorithm__use_kl_in_reward=True,
        algorithm__kl_penalty=kind,
        algorithm__kl_ctrl__kl_coef=coef,
    )
    mask = batch["response_mask"]
    kl = hand_kl(kind, batch["old_log_probs"], batch["ref_log_prob"]) * mask
    assert kl.abs().max() > 1e-4, "actor and reference agree: the KL test shows nothing"
    want = batch["token_level_scores"] - coef * kl
    torch.testing.assert_close(batch["token_level_rewards"], want, atol=1e-6, rtol=1e-5)
    # The logged KL (what an adaptive controller steers by): the mean over valid samples of
    # each sample's per-token mean.
    rows = [
        float(kl[i][mask[i].bool()].mean())
        for i in range(len(batch))
        if batch["valid_mask"][i] and mask[i].any()
    ]
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(np.mean(rows), rel=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == coef


def test_without_kl_in_reward_rewards_are_the_scores(rig):
    batch = collect(rig, algorithm__use_kl_in_reward=False)
    assert torch.equal(batch["token_level_rewards"], batch["token_level_scores"])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_weights_are_the_capped_ratio(rig, level):
    # With recomputed old log-probs the experience stage weighs; on-policy the update's own
    # forward pass does, with the same weights (tests/test_step_exactness.py).
    recompute = {"actor_rollout_ref__actor__old_log_prob": "recompute"}
    batch = collect(rig, algorithm__rollout_is=level, algorithm__rollout_is_cap=1.5, **recompute)
    mask = batch["response_mask"].bool()
    gap = (batch["old_log_probs"] - batch["rollout_log_probs"]).double() * mask
    if level == "sequence":
        gap = gap.sum(-1, keepdim=True).expand_as(gap)
    want = torch.where(mask, gap.exp().clamp(max=1.5), torch.ones_like(gap)).float()
    torch.testing.assert_close(batch["rollout_is_weights"], want, atol=1e-6, rtol=1e-6)
    # The actor multiplies them into the advantages: tests/test_actor_effects.py, with
    # weights far from 1 (here, on the trainer's own numerics, they are about 1).
    assert "rollout_is_weights" not in collect(rig, algorithm__rollout_is=None, **recompute)


def test_overlong_reward_zero_clears_only_cut_responses(rig):
    short = {"data__max_response_length": 2}
    zero = collect(rig, reward__overlong_reward="zero", **short)
    keep = collect(rig, reward__overlong_reward="keep", **short)
    assert torch.equal(zero["responses"], keep["responses"])
    cut = zero["response_clipped"].bool()
    z, k = zero["token_level_scores"].sum(-1), keep["token_level_scores"].sum(-1)
    assert cut.any() and (~cut).any()
    assert torch.all(z[cut] == 0)
    assert torch.equal(z[~cut], k[~cut])
    # A two-digit answer cut before its end-of-sequence token is still right when kept.
    assert k[cut].max() > 0, "no cut response scored: the test cannot tell keep from zero"


def test_top_p_near_zero_samples_the_greedy_answer(rig):
    """rollout.top_p reaches the sampler: a nucleus of one token is greedy decoding."""
    cfg, worker = rig["cfg"], rig["workers"].actor
    nucleus = collect(rig, actor_rollout_ref__rollout__top_p=1e-9)
    params = sampling_params(cfg, rig["processor"], step_seed(cfg, 1), greedy=True)
    greedy = worker.generate_sequences(rig["prompts"].clone().repeat(N), params)
    assert torch.equal(nucleus["responses"], greedy["responses"])
    hot = collect(rig)  # temperature 2, top_p 1: the samples of a prompt differ
    assert not torch.equal(hot["responses"], greedy["responses"])
