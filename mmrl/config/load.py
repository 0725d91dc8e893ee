"""Composing a run's config with Hydra and validating it into :class:`RunConfig`."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mmrl.config.schema import RunConfig
from mmrl.errors import ConfigError


def config_dir() -> Path:
    """The ``mmrl/configs/`` folder inside the package, so a wheel ships it."""
    return Path(__file__).resolve().parents[1] / "configs"


def compose(overrides: list[str] | None = None, config_name: str = "train") -> DictConfig:
    """Compose the Hydra config with command-line style ``overrides``.

    Raises ConfigError when an override cannot be parsed or applied, or a config is missing.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            return hydra_compose(config_name=config_name, overrides=list(overrides or []))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(_first_line(err)) from err


def load_config(overrides: list[str] | None = None, config_name: str = "train") -> RunConfig:
    """Compose ``mmrl/configs/<config_name>.yaml``, validate against :class:`RunConfig`, return
    the typed config.
    """
    raw = compose(overrides, config_name=config_name)
    try:
        OmegaConf.resolve(raw)
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), raw)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_first_line(err)) from err


def _first_line(err: Exception) -> str:
    """Hydra and OmegaConf append a multi-line context block; its first line and the key say it
    all."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    key = getattr(err, "full_key", None)
    return f"{key}: {line}" if key and not line.startswith(f"{key}:") else line
