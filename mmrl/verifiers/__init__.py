"""Verifiers: scorers of decoded responses, selected by name from ``reward.verifiers``."""

from mmrl.verifiers import text  # noqa: F401  (registers the built-in text verifiers)
from mmrl.verifiers.base import (
    VERIFIERS,
    VerifierOutput,
    as_output,
    get_verifier,
    register_verifier,
    score_batch,
)

__all__ = ["VERIFIERS", "VerifierOutput", "as_output", "get_verifier", "register_verifier", "score_batch"]
