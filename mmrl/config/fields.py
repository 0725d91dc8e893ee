"""How a config field declares its allowed values, and where its documentation lives.

A field's documentation is the string literal right under it in the dataclass (read with
:func:`field_docs`); it is written once, there, and ``docs/config.md`` is generated from it.
Allowed values sit in the field's metadata, so one validator checks every field:

    mode: str = one_of("zero", ("keep", "zero"))
    n: int = ranged(8, ge=1)
    adv_estimator: str = registry_name("grpo", "adv_estimator")
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import field
from functools import cache
from typing import Any

# Loss aggregation modes (see mmrl.algos.policy_losses.agg_loss); here because config fields
# name them.
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def one_of(default: Any, choices: tuple) -> Any:
    """A field whose value must be one of ``choices`` (None is allowed when it is a choice)."""
    return field(default=default, metadata={"choices": tuple(choices)})


def ranged(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A number within bounds (``ge <= x``, ``gt < x``, ``x <= le``, ``x < lt``); None skips
    the check when the field is optional."""
    bounds = {k: v for k, v in {"ge": ge, "gt": gt, "le": le, "lt": lt}.items() if v is not None}
    return field(default=default, metadata={"bounds": bounds})


def registry_name(default: str, registry: str) -> Any:
    """A name that must be registered in ``registry`` (checked by the trainer's preflight,
    which knows the registries)."""
    return field(default=default, metadata={"registry": registry})


def each_one_of(default: list, choices: tuple) -> Any:
    """A list whose every item must be one of ``choices``."""
    return field(default_factory=lambda: list(default), metadata={"item_choices": tuple(choices)})


BOUND_TEXT = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def bound_problem(value: Any, bounds: dict[str, float]) -> str | None:
    """What is wrong with ``value`` under ``bounds``, or None."""
    if value is None or not bounds:
        return None
    ok = {
        "ge": lambda b: value >= b,
        "gt": lambda b: value > b,
        "le": lambda b: value <= b,
        "lt": lambda b: value < b,
    }
    broken = [f"{BOUND_TEXT[k]} {b:g}" for k, b in bounds.items() if not ok[k](b)]
    return f"must be {' and '.join(broken)}" if broken else None


def describe_bounds(bounds: dict[str, float]) -> str:
    return " and ".join(f"{BOUND_TEXT[k]} {b:g}" for k, b in bounds.items())


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The documentation of each field of dataclass ``cls``: the string literal under it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
