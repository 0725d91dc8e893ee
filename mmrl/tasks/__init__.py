"""Tasks: the prompts, ground truths, tokenizer, initial model and verifiers of a run."""

from mmrl.tasks import (  # noqa: F401  (registers the tasks)
    text_addition,
    vision_parquet,
    visual_comparison,
    visual_counting,
    worldmodel_flow,
    worldmodel_latent,
    worldmodel_tokens,
)
from mmrl.tasks.base import TASKS, PromptDataset, Task, TaskData, get_task, register_task

__all__ = ["TASKS", "PromptDataset", "Task", "TaskData", "get_task", "register_task"]
