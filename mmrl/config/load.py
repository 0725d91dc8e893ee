"""Composing a run's config with Hydra and validating it into :class:`RunConfig`.

The dataclasses of :mod:`mmrl.config.schema` are the base of ``train.yaml`` (registered in
Hydra's config store as ``mmrl_run_schema``), so they hold every default and every field's
documentation; the YAML files set only what differs.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mmrl.config.schema import RunConfig
from mmrl.config.validate import field_problems, value_problems
from mmrl.errors import ConfigError

S = TypeVar("S")
SCHEMA_NAME = "mmrl_run_schema"
# Keys that moved: old key -> the key its scalar value belongs under now.
MOVED_KEYS = {
    "actor_rollout_ref.actor.policy_loss": "actor_rollout_ref.actor.policy_loss.loss_mode"
}
# verl's names that mmrl spells differently: verl's key -> mmrl's (the value is the same).
RENAMED_KEYS = {"trainer.logger": "trainer.loggers"}
OPEN_KEYS = ("task",)  # free-form sections that their owner (the task) validates


def config_dir() -> Path:
    """The ``mmrl/configs/`` folder inside the package, so a wheel ships it."""
    return Path(__file__).resolve().parents[1] / "configs"


def compose(
    overrides: list[str] | None = None, config_name: str = "train", schema: type | None = None
) -> DictConfig:
    """Compose the Hydra config with command-line style ``overrides``.

    With ``schema`` (the run config's :class:`RunConfig`), every override is checked against it
    first; all problems (unknown keys, with the closest known one, wrong types, moved keys)
    are raised together as one ConfigError, and ``task.a.b=v`` may add keys the task file
    does not set, without a ``+``. Errors of the composition itself are ConfigErrors too.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    overrides = list(overrides or [])
    if schema is RunConfig:
        problems = override_problems(overrides)
        if problems:
            raise ConfigError(problems)
        overrides = _open_task_keys(overrides)
    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            return hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_first_line(err)) from err


def load_config(
    overrides: list[str] | None = None, config_name: str = "train", validate: bool = True
) -> RunConfig:
    """Compose ``mmrl/configs/<config_name>.yaml`` with ``overrides`` into a :class:`RunConfig`.

    With ``validate`` (the default) every field's allowed values and ranges, and the batch
    sizes' divisibility, are checked; all problems are raised together as one ConfigError.
    """
    raw = compose(overrides, config_name=config_name, schema=RunConfig)
    try:
        OmegaConf.resolve(raw)
        cfg = OmegaConf.to_object(raw)
    except OmegaConfBaseException as err:
        raise ConfigError(_first_line(err)) from err
    if validate:
        problems = field_problems(cfg)
        if problems:
            raise ConfigError(problems)
    return cfg


def to_schema(cfg: Any, schema: type[S], prefix: str = "") -> S:
    """``cfg`` merged over dataclass ``schema``; missing keys take the dataclass defaults.

    An unknown key, a wrong type or a value outside its field's bounds is a one-line
    :class:`ConfigError` that names the full key (``prefix`` is where ``cfg`` sits in the
    whole config, e.g. ``task``) and, for a mistyped key, the closest known one.
    """
    dotted = f"{prefix}." if prefix else ""
    try:
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), cfg))
    except OmegaConfBaseException as err:
        text = str(err).strip().splitlines()[0]
        key = getattr(err, "full_key", None)
        raise ConfigError(
            f"{dotted}{key}: {text}{_closest_key(schema, key, dotted)}"
            if key
            else f"{prefix or schema.__name__}: {text}"
        ) from None
    problems = value_problems(obj)
    if problems:
        raise ConfigError([f"{dotted}{problem}" for problem in problems])
    return obj


def _closest_key(schema: type, key: str, dotted: str) -> str:
    """``"; did you mean <dotted>x?"`` for a mistyped ``key`` of ``schema``, or ``""``."""
    cls, parts = schema, key.split(".")
    for part in parts[:-1]:
        hints = typing.get_type_hints(cls) if is_dataclass(cls) else {}
        cls = hints.get(part)
    if not is_dataclass(cls):
        return ""
    close = difflib.get_close_matches(parts[-1], [f.name for f in fields(cls)], n=1)
    if not close or close[0] == parts[-1]:  # a known key with a wrong value: no hint
        return ""
    return f"; did you mean {dotted}{'.'.join([*parts[:-1], close[0]])}?"


def override_problems(overrides: list[str]) -> list[str]:
    """What is wrong with each ``key=value`` override: unknown key, wrong type, moved key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    problems = []
    for line in overrides:
        try:
            (override,) = OverridesParser.create().parse_overrides([line])
        except HydraException as err:
            problems.append(f"{line!r}: cannot parse this override ({_first_line(err)})")
            continue
        key = override.key_or_group
        if override.type == OverrideType.DEL or key.startswith("hydra") or override.package:
            continue
        if "." not in key and (config_dir() / key).is_dir():
            continue  # a config group: task=worldmodel_tokens
        value = override.value()
        if key in MOVED_KEYS and not isinstance(value, dict | list):
            problems.append(f"{key}={value}: this key moved; use {MOVED_KEYS[key]}={value}")
            continue
        if key in RENAMED_KEYS:
            new_line = f"{RENAMED_KEYS[key]}={line.split('=', 1)[1]}"
            problems.append(f"{key} is verl's name; mmrl's is {RENAMED_KEYS[key]}: use {new_line}")
            continue
        problem = _key_problem(key, value)
        if problem and override.type != OverrideType.FORCE_ADD:
            problems.append(problem)
    return problems


def _key_problem(key: str, value: Any) -> str | None:
    """Check ``key`` against the schema and ``value`` against its type; None when both fit."""
    cls: Any = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        known = {f.name: f for f in fields(cls)}
        if part not in known:
            where = ".".join(parts[:i]) or "the config"
            close = difflib.get_close_matches(part, list(known), n=1)
            hint = f"; did you mean {'.'.join([*parts[:i], close[0]])}?" if close else ""
            return f"{key}: unknown key {part!r} in {where}{hint}"
        target = typing.get_type_hints(cls)[part]
        if is_dataclass(target) and i < len(parts) - 1:
            cls = target
            continue
        if i < len(parts) - 1:
            return None  # inside a free-form dict (task, kwargs): its owner checks it
        try:
            OmegaConf.merge(OmegaConf.structured(cls), {part: value})
        except OmegaConfBaseException as err:
            # OmegaConf names only bool; null is the "decide for me" value of these fields.
            hint = "; expected true, false or null" if target == bool | None else ""
            return f"{key}={value!r}: {_first_line(err, with_key=False)}{hint}"
    return None


def _open_task_keys(overrides: list[str]) -> list[str]:
    """``task.a.b=v`` -> ``++task.a.b=v``: the task section is open, its task validates it."""
    out = []
    for line in overrides:
        key = line.split("=", 1)[0]
        if any(key.startswith(f"{open_key}.") for open_key in OPEN_KEYS):
            line = f"++{line}"
        out.append(line)
    return out


def _first_line(err: Exception, with_key: bool = True) -> str:
    """Hydra and OmegaConf append a multi-line context block; its first line and the key say it
    all."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    key = getattr(err, "full_key", None) if with_key else None
    if key in MOVED_KEYS:
        return f"{key}: this key moved; set {MOVED_KEYS[key]} instead"
    if key in RENAMED_KEYS:
        return f"{key} is verl's name; mmrl's is {RENAMED_KEYS[key]}: set that instead"
    return f"{key}: {line}" if key and not line.startswith(f"{key}:") else line
