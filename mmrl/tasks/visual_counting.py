"""A procedural visual-reasoning task: count the shapes of one colour in a rendered image.

Each image is drawn on a grid of cells (one shape per cell, jittered), so the answer is
exact and nothing is downloaded. The prompt asks for ``<think>...</think><answer>N</answer>``;
the ground truth is N as a string. The model is a tiny Qwen2-VL built from config
(:mod:`mmrl.models.tiny_vlm`).
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image, ImageDraw
from transformers import ProcessorMixin, Qwen2VLForConditionalGeneration

from mmrl.data import VisionPromptDataset
from mmrl.errors import ConfigError
from mmrl.models.freeze import freeze_modules
from mmrl.models.tiny_vlm import build_tiny_qwen2_vl_processor, tiny_qwen2_vl_config
from mmrl.processors.vision import VisionSample
from mmrl.processors.vision_prompts import VisionPromptProcessor
from mmrl.tasks.base import Task, TaskData, register_task, task_config
from mmrl.tasks.sft import SFTConfig
from mmrl.tasks.sft_vlm import warm_up_vlm

if TYPE_CHECKING:
    from mmrl.config import RunConfig

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
}
SHAPES = ("circle", "square", "triangle")


@dataclass
class VisualCountingConfig:
    name: str = "visual_counting"
    image_size: int = 112  # pixels per side; 112 -> 8x8 patches of 14 -> 16 vision tokens
    grid: int = 4  # cells per side; at most grid**2 shapes
    min_count: int = 1  # shapes of the asked colour
    max_count: int = 5
    max_distractors: int = 4  # shapes of other colours
    colors: list[str] = field(default_factory=lambda: ["red", "green", "blue"])
    train_size: int = 2000
    val_size: int = 128
    test_size: int = 0  # images held out for final claims only (TaskData.test); 0: none
    question: str = "How many {color} shapes are there?"
    # Where the image goes: before the question (`<image>{question}`) or after it. After it,
    # the image tokens see the asked colour (causal attention), which a 2-layer model needs.
    problem: str = "{question}<image>"
    instruction: str = " Think in <think></think>, then answer in <answer></answer>."
    model: dict[str, Any] = field(
        default_factory=dict
    )  # text-decoder overrides of tiny_qwen2_vl_config
    vision: dict[str, Any] = field(default_factory=dict)  # vision-tower overrides
    sft: SFTConfig = field(default_factory=SFTConfig)


def render_shapes(
    rng: random.Random, cfg: VisualCountingConfig, color: str, count: int
) -> Image.Image:
    """An RGB image with ``count`` shapes of ``color`` and up to ``max_distractors`` others."""
    others = [c for c in cfg.colors if c != color]
    n_distractors = rng.randint(0, min(cfg.max_distractors, cfg.grid**2 - count)) if others else 0
    fills = [color] * count + [rng.choice(others) for _ in range(n_distractors)]
    return draw_shapes(rng, cfg.image_size, cfg.grid, fills)


def draw_shapes(rng: random.Random, image_size: int, grid: int, fills: list[str]) -> Image.Image:
    """An RGB image with one random shape per colour in ``fills``, each in its own random grid
    cell."""
    cells = rng.sample(range(grid**2), len(fills))
    cell = image_size / grid
    image = Image.new("RGB", (image_size, image_size), (245, 245, 245))
    draw = ImageDraw.Draw(image)
    for fill, c in zip(fills, cells, strict=True):
        size = rng.uniform(0.45, 0.7) * cell
        # A 2 px margin inside the cell keeps shapes in neighbouring cells apart.
        x0 = (c % grid) * cell + 2 + rng.uniform(0, cell - size - 4)
        y0 = (c // grid) * cell + 2 + rng.uniform(0, cell - size - 4)
        box = (x0, y0, x0 + size, y0 + size)
        shape = rng.choice(SHAPES)
        if shape == "circle":
            draw.ellipse(box, fill=COLORS[fill])
        elif shape == "square":
            draw.rectangle(box, fill=COLORS[fill])
        else:
            draw.polygon(
                [(x0 + size / 2, y0), (x0, y0 + size), (x0 + size, y0 + size)], fill=COLORS[fill]
            )
    return image


def make_counting_dataset(cfg: VisualCountingConfig, n: int, seed: int) -> VisionPromptDataset:
    """``n`` problems; images are PNG bytes, as in the parquet layout."""
    if not 1 <= cfg.min_count <= cfg.max_count <= cfg.grid**2:
        raise ConfigError(
            f"task: need 1 <= min_count <= max_count <= grid**2, found {cfg.min_count}, "
            f"{cfg.max_count}, {cfg.grid}"
        )
    rng = random.Random(seed)
    problems, answers, images, extra = [], [], [], []
    for _ in range(n):
        color, count = rng.choice(cfg.colors), rng.randint(cfg.min_count, cfg.max_count)
        buf = io.BytesIO()
        render_shapes(rng, cfg, color, count).save(buf, format="PNG")
        problems.append(cfg.problem.format(question=cfg.question.format(color=color)))
        answers.append(str(count))
        images.append([buf.getvalue()])
        extra.append({"color": color})
    return VisionPromptDataset(problems, answers, images, extra_info=extra)


def counting_target(count: str, color: str) -> str:
    """The SFT target for one problem, in the format the verifiers check."""
    return f"<think>I count the {color} shapes: {count}.</think><answer>{count}</answer>"


@register_task("visual_counting")
class VisualCountingTask(Task[VisionPromptDataset]):
    """Interface beyond :class:`Task`: ``build_processor``, ``build_model`` and ``samples``.

    Other procedural shape tasks subclass it with their own ``config_class``,
    ``make_dataset`` and ``sft_targets``; model, processor and warm-up are shared."""

    config_class: type = VisualCountingConfig

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = task_config(self.config_class, cfg)
        self.name = self.cfg.name

    def build_data(self, seed: int) -> TaskData[VisionPromptDataset]:
        """Train, validation and (with ``test_size``) test sets from different seeds (images
        are random, so they do not repeat)."""
        test = self.make_dataset(self.cfg.test_size, seed + 20_000) if self.cfg.test_size else None
        return TaskData(
            train=self.make_dataset(self.cfg.train_size, seed),
            val=self.make_dataset(self.cfg.val_size, seed + 10_000),
            test=test,
        )

    def make_dataset(self, n: int, seed: int) -> VisionPromptDataset:
        return make_counting_dataset(self.cfg, n, seed)

    def build_processor(self) -> ProcessorMixin:
        """The HF processor; images are resized to exactly ``image_size`` squared pixels."""
        area = self.cfg.image_size**2
        return build_tiny_qwen2_vl_processor(min_pixels=area, max_pixels=area)

    def build_model(self, processor: ProcessorMixin) -> Qwen2VLForConditionalGeneration:
        """The tiny Qwen2-VL from config (``task.model``, ``task.vision``), fresh weights."""
        return Qwen2VLForConditionalGeneration(
            tiny_qwen2_vl_config(processor.tokenizer, self.cfg.model, self.cfg.vision)
        )

    def samples(
        self, dataset: VisionPromptDataset, processor: ProcessorMixin, split: str
    ) -> list[VisionSample]:
        """Chat-template samples with the answer-format instruction; cache keys
        ``<split>/<row>``."""
        return dataset.samples(processor, suffix=self.cfg.instruction, key_prefix=split)

    @staticmethod
    def sft_targets(dataset: VisionPromptDataset) -> list[str]:
        """The warm-up's target response for each problem of ``dataset``."""
        return [
            counting_target(a, info["color"])
            for a, info in zip(dataset.ground_truth, dataset.extra_info, strict=True)
        ]

    def build_prompt_processor(self, model_path: Path, cfg: RunConfig) -> VisionPromptProcessor:
        return VisionPromptProcessor.from_pretrained(model_path, cfg, self.samples)

    def initial_model(self, cfg: RunConfig) -> tuple[Path, dict[str, float]]:
        """The tiny Qwen2-VL from config after the VLM SFT warm-up (``task.sft``: a budget
        fixed before RL), saved with its processor under ``<output_dir>/init_model``. Parameters
        that ``actor.freeze_modules`` freezes in RL are frozen here too."""
        processor = self.build_processor()
        model = self.build_model(processor)
        freeze_modules(model, cfg.actor_rollout_ref.actor.freeze_modules)  # as in RL
        path = cfg.output_dir / "init_model"
        processor.save_pretrained(path)
        model.save_pretrained(
            path, safe_serialization=True
        )  # the prompt processor reads its config
        train = self.build_data(cfg.trainer.seed).train
        metrics = warm_up_vlm(
            model,
            processor,
            self.build_prompt_processor(path, cfg),
            train,
            self.sft_targets(train),
            self.cfg.sft,
            cfg.trainer.seed,
            cfg.trainer.progress_bar,
        )
        model.save_pretrained(path, safe_serialization=True)
        return path, metrics
