"""From a ``reward.verifiers`` entry to a verifier ready to run.

An entry is a ``VerifierSpec`` (``name``, ``weight`` and optional ``alias``, ``mode``,
``timeout_s``, ``chunk_size``, ``kwargs``), a ``(name, weight)`` pair, a dict with
those keys, or a bare name (weight 1). Unset run options fall back to what the
verifier declared with :func:`~mmrl.verifiers.base.verifier`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from mmrl.config.schema import VerifierSpec
from mmrl.verifiers.base import RunOptions, VerifierFn, run_options
from mmrl.verifiers.plugins import default_name, portable_ref, resolve

# The keys of one entry are the config schema's (one definition, documented there).
SPEC_FIELDS = tuple(f.name for f in fields(VerifierSpec))


@dataclass
class BoundVerifier:
    """A resolved verifier with its weight, metric name and run options.

    ``fn(batch)`` already has ``kwargs`` bound. ``portable`` is the reference that a
    worker process resolves (process mode only).
    """

    name: str
    ref: str
    weight: float
    fn: VerifierFn
    options: RunOptions
    kwargs: dict[str, Any] = field(default_factory=dict)
    portable: str | None = None


def spec_fields(spec: Any) -> dict[str, Any]:
    """The fields of one ``reward.verifiers`` entry as a dict (missing ones are None)."""
    if isinstance(spec, str):
        return {"name": spec, "weight": 1.0}
    if isinstance(spec, tuple | list):
        if len(spec) != 2:
            raise ValueError(
                f"a verifier given as a sequence must be (name, weight), found {spec!r}"
            )
        return {"name": spec[0], "weight": spec[1]}
    if isinstance(spec, Mapping):
        unknown = set(spec) - set(SPEC_FIELDS)
        if unknown:
            raise ValueError(
                f"verifier entry {dict(spec)} has unknown keys {sorted(unknown)}; known: "
                f"{SPEC_FIELDS}"
            )
        return dict(spec)
    return {key: getattr(spec, key, None) for key in SPEC_FIELDS}


def bind(spec: Any) -> BoundVerifier:
    """Resolve one ``reward.verifiers`` entry; errors name the entry."""
    fields = spec_fields(spec)
    ref = fields.get("name")
    if not ref or not isinstance(ref, str):
        raise ValueError(
            f"verifier entry {fields} needs a 'name' (a registered name, entry point, module:fn or "
            "file.py:fn)"
        )
    weight = 1.0 if fields.get("weight") is None else float(fields["weight"])
    kwargs = dict(fields.get("kwargs") or {})
    fn = resolve(ref)
    declared = run_options(fn)
    options = RunOptions(
        mode=fields.get("mode") or declared.mode,
        timeout_s=fields.get("timeout_s")
        if fields.get("timeout_s") is not None
        else declared.timeout_s,
        chunk_size=fields.get("chunk_size") or declared.chunk_size,
    )
    bound = BoundVerifier(
        name=fields.get("alias") or default_name(ref),
        ref=ref,
        weight=weight,
        fn=functools.partial(fn, **kwargs) if kwargs else fn,
        options=options,
        kwargs=kwargs,
    )
    if options.mode == "process":
        bound.portable = portable_ref(ref, fn)
    return bound


def bind_all(specs: Any) -> list[BoundVerifier]:
    """Bind every entry; metric names must be unique (set ``alias`` to tell two apart)."""
    bound = [bind(spec) for spec in specs]
    names = [b.name for b in bound]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(
            f"verifiers {dupes} appear more than once; give each an 'alias' to name its metrics"
        )
    if not bound:
        raise ValueError("reward.verifiers is empty; name at least one verifier")
    return bound


def spec_key(spec: Any) -> tuple:
    """A hashable key of one entry (used to reuse runners between calls)."""
    fields = spec_fields(spec)
    return tuple((k, repr(fields.get(k))) for k in SPEC_FIELDS)
