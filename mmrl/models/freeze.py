"""Freezing parts of a policy (e.g. a VLM's vision tower) by parameter name."""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn


def freeze_modules(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Set ``requires_grad=False`` on parameters whose name matches any regex (``re.search``).

    Call before building the optimizer. Returns the frozen names; a pattern that matches
    nothing is an error naming it and a few parameter names.
    """
    names = [name for name, _ in model.named_parameters()]
    frozen = []
    for pattern in patterns:
        regex = re.compile(pattern)
        hits = [name for name in names if regex.search(name)]
        if not hits:
            raise ValueError(
                f"actor_rollout_ref.actor.freeze_modules: {pattern!r} matches no parameter of "
                f"{type(model).__name__} (names look like {names[:3]} ... {names[-2:]})"
            )
        frozen += hits
    params = dict(model.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    return sorted(set(frozen))
