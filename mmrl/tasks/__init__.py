"""Tasks: the prompts, ground truths, tokenizer, initial model and verifiers of a run."""

from mmrl.tasks import text_addition, vision_parquet, visual_counting, worldmodel_tokens  # noqa: F401  (registers the tasks)
from mmrl.tasks.base import TASKS, PromptDataset, Task, TaskData, get_task, register_task

__all__ = ["TASKS", "PromptDataset", "Task", "TaskData", "get_task", "register_task"]
