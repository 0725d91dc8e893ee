"""What the fit loop asks of a task's prompt processor, whatever the modality."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from mmrl.protocol import Batch

D = TypeVar("D", contravariant=True)  # the dataset type of the task it serves


class PromptProcessor(Protocol[D]):
    """Turns a task's prompts (a dataset of type ``D``) into model inputs and its responses
    into what verifiers read.

    :class:`~mmrl.processors.text.TextProcessor` is the text one; a VLM processor adds
    visual inputs, a world-model processor turns context frames and actions into
    tokens and decodes predicted tokens back into frames.
    """

    def encode_dataset(self, dataset: D, split: str) -> Batch:
        """Left-padded ``input_ids``, ``attention_mask``, ``position_ids`` [B, P] plus the
        per-sample fields verifiers need (``ground_truth``, ...);
        ``meta["num_filtered_prompts"]``."""
        ...

    def decode(self, batch: Batch) -> Batch:
        """Add the decoded responses (``response_text``, predicted frames, ...) to ``batch``."""
        ...

    def sampling_overrides(self) -> dict[str, Any]:
        """:class:`~mmrl.rollout.base.SamplingParams` fields the modality fixes
        (``allowed_token_ids``, ``min_tokens``, ``max_tokens``); ``{}`` for none."""
        ...
