"""Procedural environments with actions, selected by name: ``make_env("grid")``,
``make_env("push")``.
"""

from mmrl.worldmodel.envs import grid, push  # noqa: F401  (registers the environments)
from mmrl.worldmodel.envs.base import (
    ENVS,
    ActionSpec,
    Env,
    State,
    frame_state_match,
    make_env,
    register_env,
    states_equal,
)
from mmrl.worldmodel.envs.grid import GridWorld
from mmrl.worldmodel.envs.push import PushWorld

__all__ = [
    "ENVS",
    "ActionSpec",
    "Env",
    "GridWorld",
    "PushWorld",
    "State",
    "frame_state_match",
    "make_env",
    "register_env",
    "states_equal",
]
