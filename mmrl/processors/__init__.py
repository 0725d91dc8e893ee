"""Modality processors: raw samples to model inputs, and responses back to media."""

from mmrl.processors.text import PromptTooLongError, TextProcessor
from mmrl.processors.vision import VisionProcessor, VisionSample, chat_prompt

__all__ = [
    "PromptTooLongError",
    "TextProcessor",
    "VisionProcessor",
    "VisionSample",
    "chat_prompt",
]
