"""The fit loop's prompt processor for VLM tasks: :class:`VisionProcessor` behind the
:class:`~mmrl.processors.base.PromptProcessor` interface.

A VLM task turns its dataset into chat-template :class:`VisionSample` s (its ``samples``
method); this adapter encodes them into the prompt Batch of ``docs/vlm.md`` (left-padded
tokens, mrope ``position_ids`` [B, 3, P], per-sample ``multi_modal_inputs``) with the
task's ``ground_truth`` and ``extra_info``, and decodes responses to ``response_text``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from transformers import ProcessorMixin

from mmrl.errors import DataError
from mmrl.processors.vision import VisionProcessor, VisionSample
from mmrl.protocol import Batch

if TYPE_CHECKING:
    from mmrl.config import DataConfig, RunConfig

SamplesFn = Callable[[Any, ProcessorMixin, str], list[VisionSample]]


def vision_data_config(cfg: RunConfig) -> DataConfig:
    """The ``data.*`` keys of a VLM run. The vLLM engine runs its own processor on the raw
    images, so ``rollout.name=vllm`` keeps them (``keep_raw_media``)."""
    if cfg.actor_rollout_ref.rollout.name == "vllm" and not cfg.data.keep_raw_media:
        return dataclasses.replace(cfg.data, keep_raw_media=True)
    return cfg.data


class VisionPromptProcessor:
    """Encodes a task's VLM datasets and decodes responses to text."""

    def __init__(self, vision: VisionProcessor, samples: SamplesFn) -> None:
        self.vision, self.samples = vision, samples

    @classmethod
    def from_pretrained(
        cls, model_path: str | Path, cfg: RunConfig, samples: SamplesFn
    ) -> VisionPromptProcessor:
        return cls(VisionProcessor.from_pretrained(model_path, vision_data_config(cfg)), samples)

    @property
    def pad_token_id(self) -> int:
        return self.vision.pad_token_id

    def encode_dataset(
        self, dataset: Any, split: str, extra: dict[str, list] | None = None
    ) -> Batch:
        """The prompt Batch of ``dataset`` (a :class:`~mmrl.data.VisionPromptDataset`) with
        ``ground_truth``, ``extra_info`` and any ``extra`` per-row fields as non-tensor fields."""
        if len(dataset) == 0:
            raise DataError(
                f"the {split} dataset is empty: check the task's {split} files or size settings"
            )
        samples = self.samples(dataset, self.vision.processor, split)
        fields = {
            "ground_truth": dataset.ground_truth,
            "extra_info": dataset.extra_info,
            **(extra or {}),
        }
        return self.vision.encode(samples, fields)

    def decode(self, batch: Batch) -> Batch:
        """Add ``response_text``, the decoded responses that text verifiers read."""
        texts = self.vision.decode_responses(batch["responses"], batch["response_mask"])
        batch["response_text"] = np.asarray(texts, dtype=object)
        return batch

    def sampling_overrides(self) -> dict[str, Any]:
        """Free-form text; the engines keep vision tokens out of responses themselves."""
        return {}
