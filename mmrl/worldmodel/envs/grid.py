"""A discrete grid world: an agent walks on a walled grid towards a goal.

Frames are ``size * cell`` pixels square (default 8 cells of 4 px: 32x32). A VQ
tokenizer that downsamples by 4 then gives one token per cell, which keeps token
sequences short and the per-cell content easy to learn.
"""

from __future__ import annotations

from collections import deque
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

# Actions: 0 stay, 1 up, 2 down, 3 left, 4 right, as (row, col) moves.
MOVES = np.array([[0, 0], [-1, 0], [1, 0], [0, -1], [0, 1]], dtype=np.int64)
FLOOR, WALL, GOAL, AGENT, AGENT_ON_GOAL = range(5)
PALETTE = np.array(
    [[0, 0, 0], [128, 128, 128], [0, 200, 0], [220, 40, 40], [240, 220, 40]], dtype=np.uint8
)


@register_env("grid")
class GridWorld(Env):
    """Grid world with border walls, ``n_walls`` random inner walls, a goal and an agent.

    Full state: ``walls bool [size, size]``, ``agent int64 [2]`` and ``goal int64 [2]``
    as (row, col), and ``t int64 []`` (steps taken). Moves into walls leave the
    agent in place. The agent may stand on the goal (drawn in its own colour, so
    the goal stays visible) and walk on; episodes do not end.
    """

    action_spec = ActionSpec(kind="discrete", dim=1, num_actions=len(MOVES))
    fps = 4.0

    def __init__(self, size: int = 8, cell: int = 4, n_walls: int = 6) -> None:
        if size < 4 or cell < 1:
            raise ValueError(f"grid needs size >= 4 and cell >= 1, found size={size}, cell={cell}")
        if n_walls > (size - 2) ** 2 - 2:
            raise ValueError(f"n_walls={n_walls} leaves no room on a {size}x{size} grid")
        self.size, self.cell, self.n_walls = size, cell, n_walls
        self.height = self.width = size * cell
        self._state: State | None = None

    def config(self) -> dict[str, Any]:
        return {"size": self.size, "cell": self.cell, "n_walls": self.n_walls}

    def reset(self, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        while True:
            walls = np.zeros((self.size, self.size), dtype=bool)
            walls[[0, -1], :] = walls[:, [0, -1]] = True
            inner = np.argwhere(~walls)
            for r, c in inner[rng.choice(len(inner), self.n_walls, replace=False)]:
                walls[r, c] = True
            free = np.argwhere(~walls)
            agent, goal = free[rng.choice(len(free), 2, replace=False)]
            if _reachable(walls, agent, goal):
                break
        self._state = {"walls": walls, "agent": agent, "goal": goal, "t": np.array(0)}
        return self.render()

    def step(self, action: np.ndarray | int | float) -> np.ndarray:
        state = self._require_state()
        a = int(np.asarray(action).reshape(-1)[0])
        if not 0 <= a < len(MOVES):
            raise ValueError(f"grid action must be in [0, {len(MOVES)}), found {a}")
        target = state["agent"] + MOVES[a]
        if not state["walls"][target[0], target[1]]:
            state["agent"] = target
        state["t"] = state["t"] + 1
        return self.render()

    def get_state(self) -> State:
        return {k: v.copy() for k, v in self._require_state().items()}

    def set_state(self, state: State) -> None:
        self._state = {k: np.array(state[k], copy=True) for k in ("walls", "agent", "goal", "t")}

    def observe(self, state: State) -> State:
        return {
            "walls": state["walls"].copy(),
            "agent": state["agent"].copy(),
            "goal": state["goal"].copy(),
            "valid": np.array(True),
        }

    def render_state(self, state: State) -> np.ndarray:
        cells = np.where(state["walls"], WALL, FLOOR)
        (ar, ac), (gr, gc) = state["agent"], state["goal"]
        cells[gr, gc] = GOAL
        cells[ar, ac] = AGENT_ON_GOAL if (ar, ac) == (gr, gc) else AGENT
        frame = PALETTE[cells]
        return np.repeat(np.repeat(frame, self.cell, axis=0), self.cell, axis=1)

    def state_from_frame(self, frame: np.ndarray) -> State:
        check_frame(frame, self.height, self.width)
        s, c = self.size, self.cell
        means = frame.reshape(s, c, s, c, 3).astype(np.float32).mean(axis=(1, 3))
        cells = nearest_palette(means, PALETTE)
        agents = np.argwhere((cells == AGENT) | (cells == AGENT_ON_GOAL))
        goals = np.argwhere((cells == GOAL) | (cells == AGENT_ON_GOAL))
        valid = len(agents) == 1 and len(goals) == 1
        missing = np.array([-1, -1], dtype=np.int64)
        return {
            "walls": cells == WALL,
            "agent": agents[0].astype(np.int64) if len(agents) == 1 else missing,
            "goal": goals[0].astype(np.int64) if len(goals) == 1 else missing,
            "valid": np.array(valid),
        }

    def exploration_policy(self, rng: np.random.Generator) -> Policy:
        """Keep the last move with probability 0.7, else draw a new one (stay is rare)."""
        last = [int(rng.integers(1, len(MOVES)))]
        probs = np.array([0.04] + [0.24] * (len(MOVES) - 1))

        def act() -> np.ndarray:
            if rng.random() > 0.7:
                last[0] = int(rng.choice(len(MOVES), p=probs))
            return np.array([last[0]], dtype=np.float32)

        return act

    def _require_state(self) -> State:
        if self._state is None:
            raise RuntimeError("call reset(seed) or set_state(state) before using the env")
        return self._state


def _reachable(walls: np.ndarray, start: np.ndarray, goal: np.ndarray) -> bool:
    """Breadth-first search over free cells."""
    seen = {tuple(start)}
    queue = deque([tuple(start)])
    while queue:
        cur = queue.popleft()
        if cur == tuple(goal):
            return True
        for dr, dc in MOVES[1:]:
            nxt = (cur[0] + dr, cur[1] + dc)
            if not walls[nxt] and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return False
