"""One registry type for every kind of named, pluggable thing.

Advantage estimators, policy losses, KL estimators, rollout engines, verifiers, environments,
tasks and policy families are each one :class:`Registry`. A config names an entry; the code
asks the registry for it::

    ESTIMATORS = Registry("advantage estimator", "algorithm.adv_estimator")

    @ESTIMATORS.register("grpo", needs_groups=True)
    def compute_grpo(...): ...

    ESTIMATORS.add("vllm", "mmrl.rollout.vllm:VLLMRollout")  # imported when first asked for
    ESTIMATORS.get("grpo"), ESTIMATORS.traits("grpo")["needs_groups"]

An unknown name is a :class:`~mmrl.errors.ConfigError` that lists the known names and the
closest match.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from mmrl.errors import ConfigError

T = TypeVar("T")


@dataclass
class _Entry:
    target: Any  # the object, or a "module:attr" string until first use
    traits: dict[str, Any] = field(default_factory=dict)

    @property
    def lazy(self) -> bool:
        return isinstance(self.target, str)


def _import(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """Named entries of one kind, each with optional traits (metadata such as
    ``needs_critic``).

    ``kind`` names the entries in errors ("advantage estimator"); ``key`` is the config key
    that selects one (``algorithm.adv_estimator``), so an error can say where the name came
    from.
    """

    def __init__(self, kind: str, key: str | None = None) -> None:
        self.kind, self.key = kind, key
        self._entries: dict[str, _Entry] = {}

    def register(self, name: str, **traits: Any) -> Callable[[T], T]:
        """Decorator: register the decorated object under ``name`` with ``traits``."""

        def wrap(obj: T) -> T:
            self.add(name, obj, **traits)
            return obj

        return wrap

    def add(self, name: str, target: T | str, **traits: Any) -> None:
        """Register ``target`` (an object, or ``"module:attr"`` imported on first use).

        Registering a different object under a taken name is an error; registering the same
        one again (a module imported twice) is not. A module that a lazy entry points at may
        register its object under the same name: that resolves the entry.
        """
        old = self._entries.get(name)
        if old is not None and old.target is not target:
            resolves_lazy = old.lazy and not isinstance(target, str)
            if not resolves_lazy:
                raise ValueError(f"{self.kind} {name!r} is already registered ({old.target!r})")
            traits = {**old.traits, **traits}
        self._entries[name] = _Entry(target, dict(traits))

    def get(self, name: str) -> T:
        """The entry named ``name`` (importing a lazy one); ConfigError lists the known names."""
        entry = self._entries.get(name)
        if entry is None:
            raise ConfigError(self.unknown(name))
        if entry.lazy:
            entry.target = _import(entry.target)
        return entry.target

    def traits(self, name: str) -> dict[str, Any]:
        """The traits ``name`` was registered with (a copy); ConfigError if it is unknown."""
        if name not in self._entries:
            raise ConfigError(self.unknown(name))
        return dict(self._entries[name].traits)

    def trait(self, name: str, trait: str, default: Any = None) -> Any:
        """One trait of ``name``, or ``default`` when the entry does not declare it."""
        return self.traits(name).get(trait, default)

    def unknown(self, name: Any, key: str | None = None) -> str:
        """The message for an unknown ``name`` (given at config ``key``, default the registry's):
        the known names and the closest one."""
        key = key or self.key
        where = f"{key}: " if key else ""
        close = difflib.get_close_matches(str(name), list(self._entries), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(sorted(self._entries))
        return f"{where}unknown {self.kind} {name!r}; known: {known}{hint}"

    def lazy_targets(self) -> dict[str, str]:
        """The ``"module:attr"`` strings of entries not imported yet."""
        return {n: e.target for n, e in self._entries.items() if e.lazy}

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __delitem__(self, name: str) -> None:
        """Remove an entry (tests that register throwaway entries clean up with it)."""
        del self._entries[name]

    def pop(self, name: str, *default: Any) -> Any:
        """Remove ``name`` and return its object (a lazy entry's ``"module:attr"``), or
        ``default``."""
        entry = self._entries.pop(name, None)
        if entry is None:
            if default:
                return default[0]
            raise KeyError(name)
        return entry.target

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
