"""Modality processors: raw samples to model inputs, and responses back to media."""

from mmrl.models.vlm_inputs import (
    VisionTokenMismatchError,
    collate_multi_modal,
    extend_position_ids,
    split_multi_modal,
)
from mmrl.processors.text import PromptTooLongError, TextProcessor
from mmrl.processors.vision import VisionProcessor, VisionSample, chat_prompt

__all__ = [
    "PromptTooLongError",
    "TextProcessor",
    "VisionProcessor",
    "VisionSample",
    "VisionTokenMismatchError",
    "chat_prompt",
    "collate_multi_modal",
    "extend_position_ids",
    "split_multi_modal",
]
