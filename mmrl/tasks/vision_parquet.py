"""Users' own VLM data: geometry3k-style parquet files and a local Qwen-VL checkpoint.

Point ``task.train_files``/``task.val_files`` at parquet files in the layout of
:mod:`mmrl.data.parquet` and ``actor_rollout_ref.model.path`` at a ``save_pretrained``
directory (model, processor and tokenizer). Nothing is built from config here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoProcessor, ProcessorMixin

from mmrl.data import VisionPromptDataset, load_vision_parquet
from mmrl.errors import ConfigError
from mmrl.processors.vision import VisionSample
from mmrl.processors.vision_prompts import VisionPromptProcessor
from mmrl.tasks.base import Task, TaskData, register_task, task_config

if TYPE_CHECKING:
    from mmrl.config import RunConfig


@dataclass
class VisionParquetConfig:
    name: str = "vision_parquet"
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    problem_key: str = "problem"
    answer_key: str = "answer"
    images_key: str = "images"
    videos_key: str = "videos"
    max_train_rows: int | None = None
    max_val_rows: int | None = None
    system_prompt: str | None = None
    instruction: str = " Think in <think></think>, then answer in <answer></answer>."
    # The checkpoint RL starts from (model, processor, tokenizer); the YAML sets it to
    # actor_rollout_ref.model.path.
    model_path: str | None = None


@register_task("vision_parquet")
class VisionParquetTask(Task[VisionPromptDataset]):
    """Interface beyond :class:`Task`: ``build_processor`` and ``samples``."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg: VisionParquetConfig = task_config(VisionParquetConfig, cfg)
        if not self.cfg.train_files:
            raise ConfigError("task.train_files is empty: list the parquet files to train on")
        self.name = self.cfg.name

    def _load(self, files: list[str], max_rows: int | None) -> VisionPromptDataset:
        c = self.cfg
        parts = [
            load_vision_parquet(
                f, c.problem_key, c.answer_key, c.images_key, c.videos_key, max_rows
            )
            for f in files
        ]
        return VisionPromptDataset(
            problems=[p for d in parts for p in d.problems],
            ground_truth=[a for d in parts for a in d.ground_truth],
            images=[x for d in parts for x in d.images],
            videos=[x for d in parts for x in d.videos],
            extra_info=[x for d in parts for x in d.extra_info],
        )

    def build_data(self, seed: int) -> TaskData[VisionPromptDataset]:
        train = self._load(self.cfg.train_files, self.cfg.max_train_rows)
        val_files = self.cfg.val_files or self.cfg.train_files
        return TaskData(train=train, val=self._load(val_files, self.cfg.max_val_rows))

    def initial_model(self, cfg: RunConfig) -> tuple[Path, dict[str, float]]:
        """The checkpoint named by ``task.model_path``, as is (no warm-up)."""
        return self._model_path(), {}

    def build_processor(self) -> ProcessorMixin:
        return AutoProcessor.from_pretrained(self._model_path(), local_files_only=True)

    def _model_path(self) -> Path:
        if not self.cfg.model_path:
            raise ConfigError(
                "task vision_parquet trains an existing checkpoint: set "
                "actor_rollout_ref.model.path (or task.model_path) to its save_pretrained folder"
            )
        return Path(self.cfg.model_path)

    def samples(
        self, dataset: VisionPromptDataset, processor: ProcessorMixin, split: str
    ) -> list[VisionSample]:
        return dataset.samples(
            processor, self.cfg.system_prompt, self.cfg.instruction, key_prefix=split
        )

    def build_prompt_processor(self, model_path: Path, cfg: RunConfig) -> VisionPromptProcessor:
        return VisionPromptProcessor.from_pretrained(model_path, cfg, self.samples)
