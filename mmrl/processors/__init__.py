"""Modality processors: raw samples to model inputs, and responses back to media."""

from mmrl.processors.text import PromptTooLongError, TextProcessor

__all__ = ["PromptTooLongError", "TextProcessor"]
