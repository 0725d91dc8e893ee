"""The settings of ``mmrl pretrain-worldmodel`` (``mmrl/configs/worldmodel/pretrain.yaml``)
and how they are composed and checked."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from mmrl.config.fields import ranged
from mmrl.worldmodel.pretrain_data import DataSection
from mmrl.worldmodel.token_lm import TokenLMConfig
from mmrl.worldmodel.tokenizer import AETrainConfig, VQConfig


@dataclass
class TokenizerSection:
    dir: str = "outputs/worldmodel/grid/tokenizer"
    model: VQConfig = field(default_factory=VQConfig)
    train: AETrainConfig = field(default_factory=lambda: AETrainConfig(steps=300))


@dataclass
class LMTrainSection:
    steps: int = ranged(1000, ge=1)
    batch_size: int = ranged(32, ge=1)
    lr: float = ranged(1e-3, gt=0)
    weight_decay: float = ranged(0.01, ge=0)
    warmup_steps: int = ranged(50, ge=0)
    # cosine decay to lr * this at the budget's end (1: constant)
    min_lr_ratio: float = ranged(1.0, ge=0, le=1)
    val_every: int = ranged(100, ge=1)
    val_windows: int = ranged(128, ge=1)
    patience: int = ranged(3, ge=1)
    min_delta: float = ranged(0.005, ge=0)
    eval_windows: int = ranged(64, ge=1)
    init_from: str | None = None  # a token world model to start from instead of random weights
    # loss weight of visual ids that differ from the frame before
    change_weight: float = ranged(1.0, gt=0)


@dataclass
class PretrainConfig:
    output_dir: str = "outputs/worldmodel/grid"
    seed: int = 0
    progress_bar: bool = True
    data: DataSection = field(default_factory=DataSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    model: TokenLMConfig = field(default_factory=TokenLMConfig)
    action_bins: int = ranged(9, ge=2)
    train: LMTrainSection = field(default_factory=LMTrainSection)


def load_pretrain_config(overrides: list[str] | None = None) -> PretrainConfig:
    """Compose ``mmrl/configs/worldmodel/pretrain.yaml`` with overrides and validate it.

    With ``data.videos`` and no ``output_dir`` given, the run goes to
    ``outputs/worldmodel/videos-<folder name>`` (not the environment's folder).
    """
    from mmrl.config import compose, to_schema

    overrides = list(overrides or [])
    raw = compose(overrides, config_name="worldmodel/pretrain")
    if raw.data.get("videos") and not any(o.startswith("output_dir=") for o in overrides):
        raw.output_dir = f"outputs/worldmodel/videos-{Path(str(raw.data.videos)).name}"
    OmegaConf.resolve(raw)
    return to_schema(raw, PretrainConfig)
