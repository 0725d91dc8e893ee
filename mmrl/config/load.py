"""Composing a run's config with Hydra and validating it into :class:`RunConfig`."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mmrl.config.schema import RunConfig


def config_dir() -> Path:
    """The ``mmrl/configs/`` folder inside the package, so a wheel ships it."""
    return Path(__file__).resolve().parents[1] / "configs"


def compose(overrides: list[str] | None = None, config_name: str = "train") -> DictConfig:
    """Compose the Hydra config with command-line style ``overrides``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def load_config(overrides: list[str] | None = None, config_name: str = "train") -> RunConfig:
    """Compose ``mmrl/configs/<config_name>.yaml``, validate against :class:`RunConfig`, return
    the typed config.
    """
    raw = compose(overrides, config_name=config_name)
    OmegaConf.resolve(raw)
    schema = OmegaConf.structured(RunConfig)
    merged = OmegaConf.merge(schema, raw)
    return OmegaConf.to_object(merged)
