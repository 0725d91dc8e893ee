"""Procedural environments: determinism, state restore, and the renderer's exact inverse."""

import numpy as np
import pytest

from mmrl.worldmodel.envs import ENVS, make_env, states_equal

NAMES = sorted(ENVS)


def rollout(name: str, seed: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    env = make_env(name)
    policy = env.exploration_policy(np.random.default_rng(seed + 100))
    frames, actions = [env.reset(seed)], []
    for _ in range(steps):
        actions.append(policy())
        frames.append(env.step(actions[-1]))
    return np.stack(frames), np.stack(actions)


def test_both_kinds_are_registered():
    kinds = {make_env(n).action_spec.kind for n in NAMES}
    assert {"grid", "push"} <= set(NAMES) and kinds == {"discrete", "continuous"}


@pytest.mark.parametrize("name", NAMES)
def test_seeded_and_deterministic(name):
    frames_a, actions_a = rollout(name, seed=7, steps=30)
    frames_b, actions_b = rollout(name, seed=7, steps=30)
    assert np.array_equal(frames_a, frames_b) and np.array_equal(actions_a, actions_b)
    env = make_env(name)
    assert frames_a.dtype == np.uint8 and frames_a.shape[1:] == (env.height, env.width, 3)
    assert not np.array_equal(frames_a[0], make_env(name).reset(8))
    assert not np.array_equal(frames_a[0], frames_a[-1])  # something moved


@pytest.mark.parametrize("name", NAMES)
def test_set_state_replays_exactly(name):
    env = make_env(name)
    env.reset(3)
    policy = env.exploration_policy(np.random.default_rng(0))
    for _ in range(10):
        env.step(policy())
    saved = env.get_state()
    actions = [policy() for _ in range(15)]
    first = [env.step(a) for a in actions]
    end = env.get_state()
    env.reset(99)  # anything in between
    env.set_state(saved)
    assert states_equal(env.get_state(), saved)
    second = [env.step(a) for a in actions]
    assert np.array_equal(np.stack(first), np.stack(second))
    assert states_equal(env.get_state(), end)
    env.get_state()[next(iter(saved))][...] = 0  # get_state returns a copy
    assert states_equal(env.get_state(), end)


@pytest.mark.parametrize("name", NAMES)
def test_state_from_frame_inverts_render(name):
    env = make_env(name)
    checked = 0
    for seed in range(40):
        env.reset(seed)
        policy = env.exploration_policy(np.random.default_rng(seed))
        for _ in range(25):
            env.step(policy())
            state = env.get_state()
            assert states_equal(env.state_from_frame(env.render_state(state)), env.observe(state))
            checked += 1
    assert checked == 1000


def test_push_actions_change_the_future():
    env = make_env("push")
    env.reset(0)
    start = env.get_state()
    futures = []
    for action in ([1.0, 0.0], [-1.0, 0.0]):
        env.set_state(start)
        for _ in range(8):
            frame = env.step(np.array(action))
        futures.append(frame)
    assert not np.array_equal(*futures)


def test_predicted_frames_with_a_missing_agent_are_invalid_not_errors():
    for name in NAMES:
        env = make_env(name)
        frame = env.reset(0)
        blank = np.zeros_like(frame)
        assert not bool(env.state_from_frame(blank)["valid"])
    with pytest.raises(ValueError, match=r"\[32, 32, 3\]"):
        make_env("grid").state_from_frame(np.zeros((16, 16, 3), np.uint8))


def test_unknown_env_and_bad_actions_are_clear():
    with pytest.raises(ValueError, match="unknown environment 'nope'.*grid"):
        make_env("nope")
    env = make_env("grid")
    env.reset(0)
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        env.step(7)
