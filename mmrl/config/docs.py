"""``docs/config.md``, generated from the schema: every key, its default, what it accepts and
what it means, written once under the field in :mod:`mmrl.config.schema`.

Regenerate with ``python -m mmrl.config.docs > docs/config.md``; a test fails when the file
is out of date.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, Field, fields, is_dataclass
from typing import Any

from mmrl.config.fields import describe_bounds, field_docs
from mmrl.config.schema import RunConfig

HEADER = """# Configuration reference

Every key `mmrl train` accepts, generated from `mmrl/config/schema.py`, where each field is
documented once (regenerate with `python -m mmrl.config.docs > docs/config.md`). Set a key
on the command line (`mmrl train actor_rollout_ref.rollout.n=4`) or in a YAML file under
`mmrl/configs/`. Keys under `task` belong to the task (see its file under
`mmrl/configs/task/`) and may be added without a `+` (`task.pretrain.data.env=push`).

`mmrl train --dry-run [overrides]` prints the resolved config and every problem found:
unknown keys (with the closest known one), wrong types, values out of range, batch sizes
that do not divide, unknown verifiers, tasks, engines or estimators, missing model or data
paths, prompt plus response lengths beyond the model's context, and engine limits.
"""


def _default(f: Field, value: Any) -> str:
    if is_dataclass(value):
        return ""
    if f.default is MISSING and f.default_factory is MISSING:  # type: ignore[misc]
        return "required"
    if isinstance(value, list) and value and is_dataclass(value[0]):
        return "see below"
    if value is None or isinstance(value, bool):
        return f"`{str(value).lower() if value is not None else 'null'}`"
    return f"`{value}`"


def _accepts(f: Field, type_: Any) -> str:
    meta = f.metadata
    if "choices" in meta:
        return " \\| ".join("`null`" if c is None else f"`{c}`" for c in meta["choices"])
    if "item_choices" in meta:
        return "list of " + ", ".join(f"`{c}`" for c in meta["item_choices"])
    if "registry" in meta:
        return f"a registered name ({meta['registry'].replace('_', ' ')})"
    text = getattr(type_, "__name__", None) or str(type_).replace("typing.", "")
    text = text.replace("NoneType", "null").replace(" | None", " or null")
    text = text.replace("mmrl.config.schema.", "")  # list[VerifierSpec], not its module path
    bounds = meta.get("bounds")
    return f"{text}, {describe_bounds(bounds)}" if bounds else text


def _rows(obj: Any, prefix: str, sections: list[tuple[str, Any, str]]) -> list[str]:
    hints, docs, rows = typing.get_type_hints(type(obj)), field_docs(type(obj)), []
    for f in fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if is_dataclass(value):
            sections.append((key, value, docs.get(f.name, "")))
            continue
        if isinstance(value, list) and value and is_dataclass(value[0]):
            sections.append((f"{key}[]", value[0], docs.get(f.name, "")))
        doc = docs.get(f.name, "").replace("``", "`").replace("|", "\\|")
        rows.append(f"| `{key}` | {_default(f, value)} | {_accepts(f, hints[f.name])} | {doc} |")
    return rows


def render() -> str:
    """The whole of ``docs/config.md``."""
    out = [HEADER]
    sections: list[tuple[str, Any, str]] = []
    top = RunConfig()
    for f in fields(top):
        value = getattr(top, f.name)
        if is_dataclass(value):
            sections.append((f.name, value, ""))
    loose = _rows(RunConfig(), "", [])  # the `task` section: a free-form dict
    while sections:
        name, obj, doc = sections.pop(0)
        nested: list[tuple[str, Any, str]] = []
        rows = _rows(obj, f"{name}.", nested)
        sections[:0] = nested
        if not rows:
            continue
        out.append(f"\n## `{name}`\n")
        if doc:
            out.append(f"{doc}\n")
        out.append("| key | default | accepts | meaning |\n|---|---|---|---|")
        out.extend(rows)
    out.append("\n## `task`\n")
    out.append("| key | default | accepts | meaning |\n|---|---|---|---|")
    out.extend(loose)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
