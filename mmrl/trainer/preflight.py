"""Checks that run in the first seconds of ``mmrl train``, before any expensive work.

Every problem found is collected; :func:`preflight` raises one
:class:`~mmrl.errors.ConfigError` that lists them all, each with its config key.
"""

from __future__ import annotations

from mmrl.config import RunConfig
from mmrl.errors import ConfigError, MMRLError


def verifier_problems(cfg: RunConfig) -> list[str]:
    """Each ``reward.verifiers`` entry must resolve (registered, entry point, module or file)."""
    from mmrl.verifiers.spec import bind

    problems = []
    for i, spec in enumerate(cfg.reward.verifiers):
        try:
            bind(spec)
        except MMRLError as err:
            problems.append(f"reward.verifiers[{i}].name={spec.name!r}: {err.what}")
    return problems


def find_problems(cfg: RunConfig) -> list[str]:
    """Every problem of ``cfg`` that can be found without loading models or data."""
    return verifier_problems(cfg)


def preflight(cfg: RunConfig) -> None:
    """Raise one ConfigError that names every problem of ``cfg``; return if there is none."""
    problems = find_problems(cfg)
    if problems:
        raise ConfigError(problems)
