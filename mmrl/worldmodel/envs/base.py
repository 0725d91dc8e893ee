"""The environment interface, the action spec, and the environment registry.

An environment is seeded and deterministic. Its full state (``get_state``) can be
restored exactly (``set_state``), so closed-loop scoring can replay from any point.
Its renderer has an exact inverse: ``state_from_frame(render_state(s)) ==
observe(s)``, where ``observe`` keeps what a single frame shows (e.g. the grid
cells, or object positions at pixel precision).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from mmrl.utils.registry import Registry

State = dict[str, np.ndarray]
Policy = Callable[[], np.ndarray]


@dataclass(frozen=True)
class ActionSpec:
    """How actions are stored: float32 rows of ``dim`` columns.

    ``discrete``: ``dim == 1`` and each row holds an integer id in ``[0, num_actions)``.
    ``continuous``: ``dim`` columns, each in ``[low, high]``.
    """

    kind: Literal["discrete", "continuous"]
    dim: int
    num_actions: int = 0
    low: float = -1.0
    high: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("discrete", "continuous"):
            raise ValueError(f"action kind must be 'discrete' or 'continuous', found {self.kind!r}")
        if self.kind == "discrete" and (self.dim != 1 or self.num_actions < 1):
            raise ValueError(
                f"discrete actions need dim=1 and num_actions>=1, found dim={self.dim}, "
                f"num_actions={self.num_actions}"
            )
        if self.kind == "continuous" and (self.dim < 1 or not self.low < self.high):
            raise ValueError(
                f"continuous actions need dim>=1 and low<high, found dim={self.dim}, "
                f"low={self.low}, high={self.high}"
            )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ActionSpec:
        return cls(**data)

    def check(self, actions: np.ndarray, source: str) -> None:
        """Raise if ``actions [N, dim]`` from ``source`` do not fit this spec."""
        if actions.ndim != 2 or actions.shape[1] != self.dim:
            raise ValueError(
                f"{source}: actions must have shape [N, {self.dim}], found {list(actions.shape)}"
            )
        if self.kind == "discrete":
            ok = (actions == np.round(actions)) & (actions >= 0) & (actions < self.num_actions)
            if not ok.all():
                bad = actions[~ok][0]
                raise ValueError(
                    f"{source}: discrete actions must be integers in [0, {self.num_actions}), "
                    f"found {bad}"
                )


class Env:
    """A procedural environment with actions and an invertible renderer.

    Subclasses set ``name``, ``action_spec``, ``height``, ``width`` and ``fps``, and
    implement the state methods. ``reset``/``step`` return the rendered frame.
    """

    name: str
    action_spec: ActionSpec
    height: int
    width: int
    fps: float

    def config(self) -> dict[str, Any]:
        """Constructor keyword arguments; ``make_env(name, **config)`` rebuilds the env."""
        raise NotImplementedError

    def reset(self, seed: int) -> np.ndarray:
        """Start a new episode drawn from ``seed``; returns ``frame uint8 [H, W, 3]``."""
        raise NotImplementedError

    def step(self, action: np.ndarray | int | float) -> np.ndarray:
        """Apply one action (a row of ``action_spec.dim`` values); returns the next frame."""
        raise NotImplementedError

    def get_state(self) -> State:
        """A copy of the full state; ``set_state`` of it restores the env exactly."""
        raise NotImplementedError

    def set_state(self, state: State) -> None:
        raise NotImplementedError

    def render_state(self, state: State) -> np.ndarray:
        """``frame uint8 [H, W, 3]`` of ``state`` (the env is not changed)."""
        raise NotImplementedError

    def observe(self, state: State) -> State:
        """The part of ``state`` that one frame shows, in ``state_from_frame``'s format."""
        raise NotImplementedError

    def state_from_frame(self, frame: np.ndarray) -> State:
        """Invert the renderer: ``frame uint8 [H, W, 3]`` -> observed state.

        Exact on rendered frames. On predicted frames each pixel or cell is read as
        its nearest palette colour; ``"valid"`` is False when the frame shows no
        consistent state (e.g. a missing or duplicated agent).
        """
        raise NotImplementedError

    def exploration_policy(self, rng: np.random.Generator) -> Policy:
        """A scripted behaviour policy for data generation; call it for each next action."""
        raise NotImplementedError

    def render(self) -> np.ndarray:
        """``frame uint8 [H, W, 3]`` of the current state."""
        return self.render_state(self.get_state())


ENVS: Registry[type[Env]] = Registry("environment")


def register_env(name: str) -> Callable[[type[Env]], type[Env]]:
    """Register an environment class under the name that configs and datasets use."""

    def wrap(cls: type[Env]) -> type[Env]:
        cls.name = name
        ENVS.add(name, cls)
        return cls

    return wrap


def make_env(name: str, **config: Any) -> Env:
    """A new environment of the registered kind ``name``; ConfigError lists the known kinds."""
    return ENVS.get(name)(**config)


def states_equal(a: State, b: State) -> bool:
    """Exact equality of two states (same keys, same arrays)."""
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


POSITION_FIELDS = ("pixels", "agent")


def frame_state_match(
    env: Env,
    pred: np.ndarray,
    truth: np.ndarray,
    tolerance: int = 0,
    true_state: dict[str, Any] | None = None,
) -> tuple[bool, float]:
    """``(match, position_error)`` of one predicted ``uint8 [H, W, 3]`` frame against the truth:
    the recorded observed state ``true_state`` when given, else the true frame's.

    ``position_error`` is the largest absolute coordinate difference of the positions
    (``inf`` when the predicted frame shows no valid state).
    """
    p = env.state_from_frame(pred)
    t = true_state if true_state is not None else env.state_from_frame(truth)
    if not bool(p.get("valid", True)):
        return False, float("inf")
    error, match = 0.0, True
    for key, value in t.items():
        if key == "valid":
            continue
        if key in POSITION_FIELDS:
            err = float(np.abs(np.asarray(p[key]) - np.asarray(value)).max())
            error = max(error, err)
            match &= err <= tolerance
        else:
            match &= bool(np.array_equal(p[key], value))
    return bool(match), error


def nearest_palette(pixels: np.ndarray, palette: np.ndarray) -> np.ndarray:
    """Index of the nearest palette colour for each pixel.

    Args:
        pixels: uint8 or float [..., 3].
        palette: uint8 [P, 3].

    Returns:
        int64 [...] indices into ``palette``.
    """
    diff = pixels[..., None, :].astype(np.float32) - palette.astype(np.float32)
    return np.argmin((diff**2).sum(-1), axis=-1)


def check_frame(frame: np.ndarray, height: int, width: int) -> None:
    """Raise unless ``frame`` is ``uint8 [height, width, 3]``."""
    if frame.shape != (height, width, 3) or frame.dtype != np.uint8:
        raise ValueError(
            f"expected a frame uint8 [{height}, {width}, 3], found {frame.dtype} "
            f"{list(frame.shape)}"
        )
