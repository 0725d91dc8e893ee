"""A continuous-physics push world: an agent disc pushes discs that bounce and collide.

Frames are 32x32 by default: large enough that discs of radius 3 px move visibly
by sub-disc amounts per step, small enough that rendering, tokenizing and
predicting stay cheap on a CPU. Body 0 is the agent; bodies 1.. are objects.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mmrl.worldmodel.envs.base import (
    ActionSpec,
    Env,
    Policy,
    State,
    check_frame,
    nearest_palette,
    register_env,
)

BACKGROUND = [16, 16, 32]
BODY_COLOURS = [[230, 230, 230], [230, 60, 60], [60, 200, 80], [70, 110, 240]]
# The drawn sprite (dx^2 + dy^2 <= 5: 21 px) is smaller than the physical disc (radius 3 px).
# Touching discs are >= 6 px apart, so their pixel centres floor(pos) are > 4.58 px apart;
# no integer offset has a squared length in 21..24, so centres are >= 5 px apart and the
# sprites (reach sqrt(5) = 2.24 px) never overlap.
SPRITE = np.array(
    [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3) if dx * dx + dy * dy <= 5]
)
MIN_RADIUS = 3.0


@register_env("push")
class PushWorld(Env):
    """Agent (mass 2) and ``n_objects`` discs (mass 1) in a walled square arena.

    Full state: ``pos float64 [n, 2]`` and ``vel float64 [n, 2]`` as (x, y) in
    pixels and pixels per step, and ``t int64 []``. An action ``[2]`` in [-1, 1]
    accelerates the agent. Objects keep their momentum (with a little friction),
    bounce off walls and off each other, and are pushed by the agent. Each step
    integrates ``substeps`` sub-steps with elastic-ish impulses and overlap
    correction. The observed state is each body's pixel ``(x, y) = floor(pos)``, drawn as a 21-px
    sprite.
    """

    action_spec = ActionSpec(kind="continuous", dim=2, low=-1.0, high=1.0)
    fps = 10.0
    accel, agent_damping, object_damping = 0.6, 0.7, 0.98
    max_speed, restitution = 3.0, 0.9
    masses_agent_object = (2.0, 1.0)

    def __init__(self, size: int = 32, n_objects: int = 2, radius: float = 3.0, substeps: int = 4):
        if not 1 <= n_objects <= len(BODY_COLOURS) - 1:
            raise ValueError(
                f"n_objects must be in [1, {len(BODY_COLOURS) - 1}], found {n_objects}"
            )
        if radius < MIN_RADIUS or size < 8 * radius:
            raise ValueError(
                f"push world needs radius >= 3 and size >= 8*radius, found {radius}, {size}"
            )
        self.size, self.n_objects, self.radius, self.substeps = size, n_objects, radius, substeps
        self.height = self.width = size
        self.palette = np.array([BACKGROUND, *BODY_COLOURS[: n_objects + 1]], dtype=np.uint8)
        self.mass = np.array(
            [self.masses_agent_object[0]] + [self.masses_agent_object[1]] * n_objects
        )
        self._state: State | None = None

    def config(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "n_objects": self.n_objects,
            "radius": self.radius,
            "substeps": self.substeps,
        }

    def reset(self, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        n, r = self.n_objects + 1, self.radius
        while True:
            pos = rng.uniform(r + 1, self.size - r - 1, size=(n, 2))
            dist = np.linalg.norm(pos[:, None] - pos[None], axis=-1) + np.eye(n) * 1e9
            if dist.min() > 2 * r + 1:
                break
        angle = rng.uniform(0, 2 * np.pi, size=n)
        speed = rng.uniform(0.3, 1.2, size=n)
        vel = np.stack([np.cos(angle), np.sin(angle)], axis=1) * speed[:, None]
        vel[0] = 0.0
        self._state = {"pos": pos, "vel": vel, "t": np.array(0)}
        return self.render()

    def step(self, action: np.ndarray | int | float) -> np.ndarray:
        state = self._require_state()
        a = np.clip(np.asarray(action, dtype=np.float64).reshape(-1), -1.0, 1.0)
        if a.shape != (2,):
            raise ValueError(f"push action must have 2 values, found {a.shape[0]}")
        vel = state["vel"]
        vel[0] = vel[0] * self.agent_damping + a * self.accel
        vel[1:] *= self.object_damping
        speed = np.linalg.norm(vel, axis=1, keepdims=True)
        vel *= np.minimum(1.0, self.max_speed / np.maximum(speed, 1e-12))
        for _ in range(self.substeps):
            state["pos"] += vel / self.substeps
            self._bounce_walls(state["pos"], vel)
            self._collide(state["pos"], vel)
        state["t"] = state["t"] + 1
        return self.render()

    def _bounce_walls(self, pos: np.ndarray, vel: np.ndarray) -> None:
        lo, hi = self.radius, self.size - self.radius
        below, above = pos < lo, pos > hi
        pos[:] = np.where(below, 2 * lo - pos, np.where(above, 2 * hi - pos, pos))
        vel[:] = np.where(below, np.abs(vel), np.where(above, -np.abs(vel), vel))
        vel[0] = np.where(below[0] | above[0], 0.0, vel[0])  # the agent stops at walls
        np.clip(pos, lo, hi, out=pos)

    def _collide(self, pos: np.ndarray, vel: np.ndarray, iterations: int = 4) -> None:
        """Pairwise impulses for approaching discs, then overlap correction by mass."""
        n, min_dist = len(pos), 2 * self.radius
        inv_m = 1.0 / self.mass
        for it in range(iterations):
            for i in range(n):
                for j in range(i + 1, n):
                    d = pos[j] - pos[i]
                    dist = float(np.hypot(d[0], d[1]))
                    if dist >= min_dist:
                        continue
                    normal = d / dist if dist > 1e-9 else np.array([1.0, 0.0])
                    vn = float((vel[j] - vel[i]) @ normal)
                    if it == 0 and vn < 0:
                        impulse = -(1 + self.restitution) * vn / (inv_m[i] + inv_m[j])
                        vel[i] -= impulse * inv_m[i] * normal
                        vel[j] += impulse * inv_m[j] * normal
                    push = (min_dist - dist) / (inv_m[i] + inv_m[j])
                    pos[i] -= push * inv_m[i] * normal
                    pos[j] += push * inv_m[j] * normal
            np.clip(pos, self.radius, self.size - self.radius, out=pos)

    def get_state(self) -> State:
        return {k: v.copy() for k, v in self._require_state().items()}

    def set_state(self, state: State) -> None:
        self._state = {
            k: np.array(state[k], dtype=dt)
            for k, dt in (("pos", np.float64), ("vel", np.float64), ("t", np.int64))
        }

    def observe(self, state: State) -> State:
        return {"pixels": np.floor(state["pos"]).astype(np.int64), "valid": np.array(True)}

    def render_state(self, state: State) -> np.ndarray:
        frame = np.empty((self.size, self.size, 3), dtype=np.uint8)
        frame[:] = self.palette[0]
        for body, (x, y) in enumerate(self.observe(state)["pixels"]):
            frame[y + SPRITE[:, 0], x + SPRITE[:, 1]] = self.palette[body + 1]
        return frame

    def state_from_frame(self, frame: np.ndarray) -> State:
        """Each body's pixel is the rounded centroid of the pixels nearest its colour."""
        check_frame(frame, self.height, self.width)
        labels = nearest_palette(frame, self.palette)
        pixels = np.full((self.n_objects + 1, 2), -1, dtype=np.int64)
        for body in range(self.n_objects + 1):
            ys, xs = np.nonzero(labels == body + 1)
            if len(xs):
                pixels[body] = np.round([xs.mean(), ys.mean()]).astype(np.int64)
        return {"pixels": pixels, "valid": np.array(bool((pixels >= 0).all()))}

    def exploration_policy(self, rng: np.random.Generator) -> Policy:
        """Head for a chosen object (or wander in a fixed direction), re-choosing now and then.

        Chasing objects makes collisions frequent, so actions visibly change the future.
        """
        plan = {"target": 0, "direction": np.zeros(2)}

        def choose() -> None:
            plan["target"] = int(rng.integers(0, self.n_objects + 1))  # 0 means wander
            angle = rng.uniform(0, 2 * np.pi)
            plan["direction"] = np.array([np.cos(angle), np.sin(angle)])

        choose()

        def act() -> np.ndarray:
            if rng.random() < 0.12:
                choose()
            pos = self._require_state()["pos"]
            direction = plan["direction"]
            if plan["target"]:
                d = pos[plan["target"]] - pos[0]
                direction = d / max(float(np.linalg.norm(d)), 1e-9)
            action = direction * rng.uniform(0.5, 1.0) + rng.normal(0, 0.3, size=2)
            return np.clip(action, -1.0, 1.0).astype(np.float32)

        return act

    def _require_state(self) -> State:
        if self._state is None:
            raise RuntimeError("call reset(seed) or set_state(state) before using the env")
        return self._state
