"""A procedural visual-reasoning task: which of two colours has more shapes in a rendered image.

The image holds ``a`` shapes of one colour and ``b`` of another, ``|a - b| >= min_margin`` (plus
shapes of
a third colour); the prompt asks "Are there more red or blue shapes?" and the ground truth is
the colour with more shapes. The answer is one of two words, so every sampled answer's reward
tells the policy which one is right: GRPO gets almost a label per prompt, and a short RL run
improves a tiny model here (docs/benchmarks.md), unlike on five-way counting. Scored with
``choice_answer`` (the ``<answer>`` text against the ground truth) and ``format``.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field
from typing import Any

from mmrl.data import VisionPromptDataset
from mmrl.errors import ConfigError
from mmrl.tasks.base import register_task
from mmrl.tasks.sft import SFTConfig
from mmrl.tasks.visual_counting import VisualCountingTask, draw_shapes


@dataclass
class VisualComparisonConfig:
    name: str = "visual_comparison"
    image_size: int = 112  # 112 px -> 16 vision tokens, one per grid cell
    grid: int = 4
    min_count: int = 1  # shapes of each compared colour
    max_count: int = 6
    min_margin: int = 2  # the two counts differ by at least this much
    max_distractors: int = 2  # shapes of the third colour
    colors: list[str] = field(default_factory=lambda: ["red", "green", "blue"])
    train_size: int = 2000
    val_size: int = 128
    test_size: int = 0  # images held out for final claims only (TaskData.test); 0: none
    question: str = "Are there more {first} or {second} shapes?"
    problem: str = "{question}<image>"  # image after the question, as in visual_counting
    instruction: str = " Think in <think></think>, then answer in <answer></answer>."
    model: dict[str, Any] = field(default_factory=dict)
    vision: dict[str, Any] = field(default_factory=dict)
    sft: SFTConfig = field(default_factory=SFTConfig)


def make_comparison_dataset(cfg: VisualComparisonConfig, n: int, seed: int) -> VisionPromptDataset:
    """``n`` problems with PNG image bytes; either colour is the answer equally often."""
    if len(cfg.colors) < 2:
        raise ConfigError(
            f"task.colors: visual_comparison needs at least 2 colours, found {cfg.colors}"
        )
    if not 1 <= cfg.min_count <= cfg.max_count - cfg.min_margin:
        raise ConfigError(
            f"task: need 1 <= min_count <= max_count - min_margin, found {cfg.min_count}, "
            f"{cfg.max_count}, {cfg.min_margin}"
        )
    if 2 * cfg.max_count + cfg.max_distractors > cfg.grid**2:
        raise ConfigError(
            f"task: 2 * max_count + max_distractors = "
            f"{2 * cfg.max_count + cfg.max_distractors} shapes do not fit a "
            f"{cfg.grid}x{cfg.grid} grid"
        )
    rng = random.Random(seed)
    problems, answers, images, extra = [], [], [], []
    for _ in range(n):
        more, fewer, *others = rng.sample(cfg.colors, len(cfg.colors))
        n_fewer = rng.randint(cfg.min_count, cfg.max_count - cfg.min_margin)
        n_more = rng.randint(n_fewer + cfg.min_margin, cfg.max_count)
        n_other = rng.randint(0, cfg.max_distractors) if others else 0
        fills = [more] * n_more + [fewer] * n_fewer + [rng.choice(others) for _ in range(n_other)]
        first, second = (more, fewer) if rng.random() < 0.5 else (fewer, more)
        buf = io.BytesIO()
        draw_shapes(rng, cfg.image_size, cfg.grid, fills).save(buf, format="PNG")
        problems.append(
            cfg.problem.format(question=cfg.question.format(first=first, second=second))
        )
        answers.append(more)
        images.append([buf.getvalue()])
        extra.append({"first": first, "second": second, "counts": {more: n_more, fewer: n_fewer}})
    return VisionPromptDataset(problems, answers, images, extra_info=extra)


def comparison_target(answer: str) -> str:
    """The SFT target for one problem: the format the verifiers check, the answer in the tag.

    The thought is the same for every problem: with the colours restated in it, sampled
    responses often miscopied a colour and answered a third one, which adds reward noise
    that has nothing to do with the image.
    """
    return f"<think>compare</think><answer>{answer}</answer>"


@register_task("visual_comparison")
class VisualComparisonTask(VisualCountingTask):
    """The tiny Qwen2-VL, processor and SFT warm-up of :class:`VisualCountingTask`, on
    comparisons."""

    config_class = VisualComparisonConfig

    def make_dataset(self, n: int, seed: int) -> VisionPromptDataset:
        return make_comparison_dataset(self.cfg, n, seed)

    @staticmethod
    def sft_targets(dataset: VisionPromptDataset) -> list[str]:
        return [comparison_target(a) for a in dataset.ground_truth]
