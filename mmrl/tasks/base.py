"""What a task provides to the fit loop, and the task registry.

A task is four methods: its data, the processor for its prompts, the model RL starts
from, and what happens after RL. The fit loop is the same for every task.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from transformers import AutoTokenizer

from mmrl.config.load import to_schema
from mmrl.processors.base import PromptProcessor
from mmrl.processors.text import TextProcessor
from mmrl.utils.registry import Registry

if TYPE_CHECKING:
    from mmrl.config import RunConfig

C = TypeVar("C")
D = TypeVar("D")  # a task's dataset type: PromptDataset, VisionPromptDataset, FrameWindows, ...


def task_config(schema: type[C], cfg: Any, prefix: str = "task") -> C:
    """The run's ``task`` group merged over the task's config dataclass ``schema``
    (:func:`mmrl.config.to_schema`; ``prefix`` is where ``cfg`` sits in the run config)."""
    return to_schema(cfg, schema, prefix)


@dataclass
class PromptDataset:
    """Prompts with their ground truths and optional per-sample extra info."""

    prompts: list[str]
    ground_truth: list[Any]
    extra_info: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.ground_truth):
            raise ValueError(
                f"dataset has {len(self.prompts)} prompts but {len(self.ground_truth)} ground "
                "truths"
            )
        if not self.extra_info:
            self.extra_info = [{} for _ in self.prompts]

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class TaskData(Generic[D]):
    """A task's splits, each of the task's dataset type ``D``. ``train`` feeds RL; ``val`` is
    what the run validates on and what checkpoint selection, early stopping and tuning may
    read; ``test`` is held out for final claims (end-of-run comparisons, benchmark tables)
    and read by nothing else."""

    train: D
    val: D
    test: D | None = None


TASKS: Registry[type] = Registry("task", "task.name")


def register_task(name: str) -> Callable[[type], type]:
    """Register a task class under the name ``task.name`` (and ``task=<file>``) uses."""
    return TASKS.register(name)


def get_task(name: str) -> type:
    """The task class registered as ``name``; ConfigError lists the known tasks."""
    return TASKS.get(name)


class Task(Generic[D]):
    """Interface of a task over datasets of type ``D``. Subclasses parse ``cfg.task`` into
    their own settings (:func:`task_config`).

    Starting points that need training (an SFT warm-up, MLE pretraining) are made in
    :meth:`initial_model` with the helpers of :mod:`mmrl.tasks.sft` and
    :mod:`mmrl.tasks.sft_vlm`.
    """

    name: str
    # The policy family of the model initial_model makes (None: known only from the folder).
    policy_family: str | None = None

    def build_data(self, seed: int) -> TaskData[D]:
        """The task's splits, drawn or read with ``seed``."""
        raise NotImplementedError

    def build_prompt_processor(self, model_path: Path, cfg: RunConfig) -> PromptProcessor[D]:
        """The processor for this task's prompts and responses; text by default."""
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        return TextProcessor(
            tokenizer, cfg.data.max_prompt_length, cfg.data.filter_overlong_prompts
        )

    def initial_model(self, cfg: RunConfig) -> tuple[Path, dict[str, float]]:
        """A local checkpoint folder to start RL from when ``actor_rollout_ref.model.path`` is
        not set, made the task's own way (built from config and warmed up, pretrained, or
        named in the task's config), with metrics to log at step 0."""
        raise NotImplementedError

    def complete_checkpoint(self, base_dir: Path, actor_dir: Path) -> None:
        """Copy into a saved actor folder the files of the starting model (``base_dir``)
        that evaluating it needs beyond what its policy family saves. Nothing by default."""

    def on_fit_end(
        self, cfg: RunConfig, base_dir: Path, actor_dir: Path, history: list[dict]
    ) -> dict[str, Any]:
        """Task-specific work after RL (held-out comparisons, reports), given the starting
        model and the final actor; returns entries for ``summary.json``. Nothing by default."""
        return {}
