"""Closed-loop evaluation: plan with a world model, act in the real environment.

A planner that uses a world model succeeds at a task only if the model predicts how
actions change the world. This is an evaluation (too slow to be a reward): per
episode the real environment starts from a seed; every ``replan_every`` steps a
random-shooting MPC planner samples ``candidates`` action sequences of ``horizon``
steps, lets the world model predict their frames, reads each predicted frame's state
with the renderer's exact inverse (``env.state_from_frame``), scores it with the
task's cost, and executes the first actions of the cheapest sequence in the real
environment. Success is judged on the real environment's true state.

Tasks (:func:`make_goal`):

- ``grid`` / ``reach_goal``: the agent stands on the goal cell (drawn in every frame).
  Cost: Manhattan distance from the agent to the goal.
- ``push`` / ``push_object``: object 1's pixel position comes within ``radius`` px of
  a target point (drawn from the episode seed, at least ``min_distance`` px from the
  object's start; not shown in frames, the planner is told it). Cost: the object's
  distance to the target plus ``0.3`` times the agent's distance to the object.
- ``push`` / ``reach``: the same for the agent itself (body 0).

A world model enters through one function, :class:`FramePredictor`:
``predict(context_frames uint8 [N, K, H, W, 3], actions float32 [N, K+T-1, A]) ->
frames uint8 [N, T, H, W, 3]``. :class:`LatentPredictor` wraps the latent policy and
its autoencoder (mean predictions); :class:`TokenPredictor` a token world model and
its VQ tokenizer (greedy tokens); :class:`SimulatorPredictor` replays the true
environment (an upper bound for any learned model); ``policy="random"`` is the
baseline without a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from mmrl.worldmodel.envs import Env, State

INVALID_COST = 1e6


class FramePredictor(Protocol):
    context: int

    def predict(self, context_frames: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """``context_frames uint8 [N, K, H, W, 3]``, ``actions float32 [N, K+T-1, A]`` -> ``uint8
        [N, T, H, W, 3]``.
        """
        ...


class LatentPredictor:
    """Greedy (mean) multi-step predictions of a Gaussian latent policy, decoded by its
    autoencoder."""

    def __init__(self, policy, ae, batch_size: int = 256) -> None:
        self.policy, self.ae, self.batch_size = policy.eval(), ae, batch_size
        self.context = policy.cfg.context

    @torch.no_grad()
    def predict(self, context_frames: np.ndarray, actions: np.ndarray) -> np.ndarray:
        n, k = context_frames.shape[:2]
        t = actions.shape[1] - k + 1
        z = self.ae.encode(context_frames.reshape(-1, *context_frames.shape[2:])).reshape(
            n, k, *self.ae.latent_shape
        )
        act = torch.from_numpy(np.asarray(actions, dtype=np.float32))
        preds = []
        for step in range(t):
            mean, _ = self.policy(z[:, -k:], act[:, step : step + k])
            preds.append(mean)
            z = torch.cat([z, mean.unsqueeze(1)], dim=1)
        frames = self.ae.decode(torch.stack(preds, 1).flatten(0, 1), batch_size=self.batch_size)
        return frames.reshape(n, t, *frames.shape[1:])


class TokenPredictor:
    """Greedy, visual-token-constrained predictions of a token world model, decoded by its VQ
    tokenizer.

    ``model``, ``processor`` as from :func:`~mmrl.worldmodel.token_lm.load_token_world_model`
    (its ``context`` is used; the horizon comes from the actions), ``tokenizer`` a
    :class:`~mmrl.worldmodel.tokenizer.VQTokenizer`. Undecodable predictions are black
    frames, which show no valid state and so cost the planner the most.
    """

    def __init__(self, model, processor, tokenizer) -> None:
        self.model, self.processor, self.tokenizer = model, processor, tokenizer
        self.context = processor.context

    @torch.no_grad()
    def predict(self, context_frames: np.ndarray, actions: np.ndarray) -> np.ndarray:
        from mmrl.worldmodel.pretrain import greedy_responses
        from mmrl.worldmodel.token_lm import TokenWorldModelProcessor

        n, k = context_frames.shape[:2]
        proc = TokenWorldModelProcessor(
            self.processor.layout, k, actions.shape[1] - k + 1, self.processor.action_form
        )
        codes = self.tokenizer.encode(context_frames.reshape(-1, *context_frames.shape[2:]))
        codes = codes.reshape(n, k, *codes.shape[1:])
        prompts = torch.tensor([proc.build_prompt(codes[i], actions[i]) for i in range(n)])
        forced = torch.from_numpy(np.stack([proc.forced_response(a) for a in actions]))
        responses = greedy_responses(self.model, prompts, proc, forced)
        frames, _, _ = proc.decode_frames(responses.tolist(), self.tokenizer)
        return frames


class SimulatorPredictor:
    """The true environment as a world model: replays candidate actions from the real env's current
    state.

    Reads ``env.get_state()`` at each call, so it must be called while ``env`` is at the
    state the context frames end in (as :func:`run_episode` does).
    """

    def __init__(self, env: Env, context: int = 2) -> None:
        self.env, self.context = env, context
        self.sim = type(env)(**env.config())

    def predict(self, context_frames: np.ndarray, actions: np.ndarray) -> np.ndarray:
        start, k = self.env.get_state(), context_frames.shape[1]
        out = []
        for row in actions:
            self.sim.set_state(start)
            out.append(np.stack([self.sim.step(a) for a in row[k - 1 :]]))
        return np.stack(out)


@dataclass
class Goal:
    """A task: ``cost(observed state) -> float`` (lower is better) and ``success(true observed
    state)``.
    """

    name: str
    cost: Callable[[State], float]
    success: Callable[[State], bool]


def make_goal(
    env: Env, task: str, seed: int, radius: float = 4.0, min_distance: float = 10.0
) -> Goal:
    """The goal of one episode; ``env`` must already be reset with ``seed`` (see the module
    docstring).
    """
    if env.name == "grid" and task == "reach_goal":

        def dist(s: State) -> float:
            return float(np.abs(s["agent"] - s["goal"]).sum())

        return Goal(task, dist, lambda s: dist(s) == 0)
    if env.name == "push" and task in ("push_object", "reach"):
        body = 1 if task == "push_object" else 0
        start = env.observe(env.get_state())["pixels"][body].astype(float)
        rng = np.random.default_rng([seed, 7])
        margin = env.radius + 2
        while True:
            target = rng.uniform(margin, env.size - margin, size=2)
            if np.linalg.norm(target - start) >= min_distance:
                break

        def cost(s: State) -> float:
            px = s["pixels"].astype(float)
            c = float(np.linalg.norm(px[body] - target))
            return c + (0.3 * float(np.linalg.norm(px[0] - px[body])) if body else 0.0)

        def success(s: State) -> bool:
            return float(np.linalg.norm(s["pixels"][body].astype(float) - target)) <= radius

        return Goal(task, cost, success)
    raise ValueError(
        f"no planning task {task!r} for env {env.name!r}; known: grid/reach_goal, "
        "push/push_object, push/reach"
    )


@dataclass
class PlannerConfig:
    horizon: int = 4  # predicted steps per candidate
    candidates: int = 64  # action sequences per plan
    replan_every: int = 2  # actions executed from each plan
    max_steps: int = 30  # actions per episode
    context: int = 2  # frames the world model reads (warm-up: K-1 null actions)


def sample_actions(env: Env, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Uniform random actions ``float32 [*shape, A]`` in the env's action space."""
    spec = env.action_spec
    if spec.kind == "discrete":
        return rng.integers(0, spec.num_actions, size=(*shape, 1)).astype(np.float32)
    return rng.uniform(spec.low, spec.high, size=(*shape, spec.dim)).astype(np.float32)


def null_action(env: Env) -> np.ndarray:
    return np.zeros(env.action_spec.dim, dtype=np.float32)  # grid: stay; push: no thrust


def plan(
    predictor: FramePredictor,
    env: Env,
    goal: Goal,
    frames: list[np.ndarray],
    actions: list[np.ndarray],
    cfg: PlannerConfig,
    rng: np.random.Generator,
) -> np.ndarray:
    """The cheapest of ``cfg.candidates`` random action sequences ``[horizon, A]`` under
    ``predictor``.

    A candidate's cost is the minimum over its predicted frames of ``goal.cost`` (frames
    that show no valid state cost ``INVALID_COST``), plus a small tie-break on the last frame.
    """
    k = predictor.context
    cands = sample_actions(env, rng, (cfg.candidates, cfg.horizon))
    past = (
        np.stack(actions[len(actions) - (k - 1) :])
        if k > 1
        else np.zeros((0, cands.shape[-1]), np.float32)
    )
    full = np.concatenate([np.broadcast_to(past, (cfg.candidates, *past.shape)), cands], axis=1)
    context = np.broadcast_to(np.stack(frames[-k:]), (cfg.candidates, k, *frames[-1].shape))
    predicted = predictor.predict(np.ascontiguousarray(context), np.ascontiguousarray(full))
    costs = np.empty((cfg.candidates, cfg.horizon))
    for i in range(cfg.candidates):
        for j in range(cfg.horizon):
            state = env.state_from_frame(predicted[i, j])
            costs[i, j] = goal.cost(state) if bool(state["valid"]) else INVALID_COST
    total = costs.min(1) + 1e-3 * costs[:, -1]
    return cands[int(np.argmin(total))]


def run_episode(
    env: Env,
    task: str,
    seed: int,
    cfg: PlannerConfig,
    predictor: FramePredictor | None = None,
) -> dict[str, float]:
    """One episode in the real ``env``; ``predictor=None`` acts uniformly at random.

    Returns ``success`` (1/0: the goal held on the true state at some step), ``steps``
    (actions taken until then) and ``final_cost`` (the goal's cost on the last true state).
    """
    rng = np.random.default_rng([seed, 11])
    frames, actions = [env.reset(seed)], []
    goal = make_goal(env, task, seed)
    for _ in range(cfg.context - 1):  # warm-up so the model has K context frames
        actions.append(null_action(env))
        frames.append(env.step(actions[-1]))
    queue: list[np.ndarray] = []
    for step in range(1, cfg.max_steps + 1):
        if not queue:
            chosen = (
                sample_actions(env, rng, (cfg.replan_every,))
                if predictor is None
                else plan(predictor, env, goal, frames, actions, cfg, rng)[: cfg.replan_every]
            )
            queue = list(chosen)
        actions.append(queue.pop(0))
        frames.append(env.step(actions[-1]))
        if goal.success(env.observe(env.get_state())):
            return {
                "success": 1.0,
                "steps": float(step),
                "final_cost": goal.cost(env.observe(env.get_state())),
            }
    return {
        "success": 0.0,
        "steps": float(cfg.max_steps),
        "final_cost": goal.cost(env.observe(env.get_state())),
    }


def evaluate_planner(
    env: Env,
    task: str,
    predictors: dict[str, FramePredictor | None],
    episodes: int = 20,
    cfg: PlannerConfig | None = None,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Success rate, mean steps and mean final cost per predictor over the same ``episodes`` seeds.

    ``predictors`` maps a name to a :class:`FramePredictor`, or to ``None`` for the random
    policy, e.g. ``{"random": None, "latent": LatentPredictor(policy, ae)}``.
    """
    cfg = cfg or PlannerConfig()
    seeds = [int(s) for s in np.random.SeedSequence(seed).generate_state(episodes)]
    results = {}
    for name, predictor in predictors.items():
        runs = [run_episode(env, task, s, cfg, predictor) for s in seeds]
        results[name] = {
            "success_rate": float(np.mean([r["success"] for r in runs])),
            "mean_steps": float(np.mean([r["steps"] for r in runs])),
            "mean_final_cost": float(np.mean([r["final_cost"] for r in runs])),
            "episodes": float(episodes),
        }
    return results
