"""What the fit loop asks of a task's prompt processor, whatever the modality."""

from __future__ import annotations

from typing import Any, Protocol

from mmrl.protocol import Batch


class PromptProcessor(Protocol):
    """Turns a task's prompts into model inputs and its responses into what verifiers read.

    :class:`~mmrl.processors.text.TextProcessor` is the text one; a VLM processor adds
    visual inputs, a world-model processor turns context frames and actions into
    tokens and decodes predicted tokens back into frames.
    """

    @property
    def pad_token_id(self) -> int: ...

    def encode_dataset(self, dataset: Any, split: str) -> Batch:
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
