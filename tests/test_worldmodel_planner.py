"""Closed-loop planner evaluation: plan with a world model, act in the real environment."""

from __future__ import annotations

import numpy as np
import torch

from mmrl.models.latent_policy import GaussianLatentPolicy, LatentPolicyConfig
from mmrl.worldmodel.envs import make_env
from mmrl.worldmodel.latent_ae import AEConfig, LatentAutoencoder, build_ae_model
from mmrl.worldmodel.planner import (
    LatentPredictor,
    PlannerConfig,
    SimulatorPredictor,
    evaluate_planner,
    make_goal,
    run_episode,
)


def test_planning_with_the_true_dynamics_beats_acting_at_random():
    env = make_env("grid")
    cfg = PlannerConfig(horizon=4, candidates=32, replan_every=2, max_steps=20)
    results = evaluate_planner(
        env,
        "reach_goal",
        {"random": None, "simulator": SimulatorPredictor(env)},
        episodes=8,
        cfg=cfg,
    )
    assert results["simulator"]["success_rate"] >= 0.75
    assert results["simulator"]["success_rate"] > results["random"]["success_rate"]
    assert results["simulator"]["mean_steps"] < results["random"]["mean_steps"]


def test_push_goals_and_a_latent_world_model_in_the_loop():
    env = make_env("push")
    env.reset(3)
    goal = make_goal(env, "push_object", seed=3)
    state = env.observe(env.get_state())
    assert not goal.success(state) and goal.cost(state) >= 10.0  # targets start >= 10 px away
    torch.manual_seed(0)
    ae = LatentAutoencoder(build_ae_model(AEConfig(), 32))
    policy = GaussianLatentPolicy(LatentPolicyConfig(context=2, action_dim=2, hidden=8))
    predictor = LatentPredictor(policy, ae)
    frames = np.stack([env.reset(s) for s in range(2)])
    out = predictor.predict(frames[None].repeat(3, 0), np.zeros((3, 2 + 3 - 1, 2), np.float32))
    assert out.shape == (3, 3, 32, 32, 3) and out.dtype == np.uint8
    result = run_episode(
        env,
        "reach",
        seed=1,
        cfg=PlannerConfig(candidates=4, horizon=2, max_steps=3),
        predictor=predictor,
    )
    assert set(result) == {"success", "steps", "final_cost"} and result["steps"] <= 3


def test_a_token_world_model_predicts_frames_for_the_planner():
    from mmrl.worldmodel.planner import TokenPredictor
    from mmrl.worldmodel.token_lm import (
        TokenLMConfig,
        TokenWorldModelProcessor,
        build_token_world_model,
    )
    from mmrl.worldmodel.tokenizer import VQConfig, VQTokenizer, build_vq_model
    from mmrl.worldmodel.vocab import VocabLayout

    env = make_env("grid")
    torch.manual_seed(0)
    tok = VQTokenizer(build_vq_model(VQConfig(codebook_size=16, block_out_channels=[8, 8, 8]), 32))
    proc = TokenWorldModelProcessor(VocabLayout(16, tok.grid, env.action_spec), context=2, future=1)
    model = build_token_world_model(
        proc, TokenLMConfig(64, 64, 1, 1, 1, max_position_embeddings=512)
    )
    predictor = TokenPredictor(model, proc, tok)
    frames = np.stack([env.reset(0), env.step(1)])
    out = predictor.predict(frames[None].repeat(2, 0), np.ones((2, 2 + 2 - 1, 1), np.float32))
    assert out.shape == (2, 2, 32, 32, 3) and out.dtype == np.uint8
    result = run_episode(
        env,
        "reach_goal",
        seed=0,
        cfg=PlannerConfig(candidates=2, horizon=2, max_steps=2),
        predictor=predictor,
    )
    assert result["steps"] <= 2
