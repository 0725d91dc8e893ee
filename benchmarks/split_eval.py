"""Before-and-after-RL accuracy on a task's test split, for the multi-seed benchmarks."""

from __future__ import annotations

from pathlib import Path

from mmrl.config import RunConfig
from mmrl.tasks import get_task
from mmrl.trainer.eval_split import accuracy, checkpoint_scores


def test_split_accuracy(cfg: RunConfig, samples: int = 4) -> dict[str, float]:
    """Accuracy of the starting model (``init_model``) and the RL actor on the test split,
    sampled (``samples`` per prompt, temperature 1, the same seeds for both) and greedy."""
    test = get_task(cfg.task["name"])(cfg.task).build_data(cfg.trainer.seed).test
    if test is None:
        raise ValueError("the task has no test split: set task.test_size")
    out: dict[str, float] = {"test_prompts": float(len(test))}
    for label, folder in (("before", "init_model"), ("after", "actor")):
        path = Path(cfg.output_dir) / folder
        sampled = checkpoint_scores(path, cfg, test, samples=samples, do_sample=True)
        out[label] = accuracy(sampled, cfg)
        out[f"greedy_{label}"] = accuracy(checkpoint_scores(path, cfg, test), cfg)
    return out
