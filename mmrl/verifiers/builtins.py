"""Importing this module registers the built-in verifiers."""

from mmrl.verifiers import (  # noqa: F401
    closed_loop,
    image,
    lpips,
    reasoning,
    repetition,
    state_match,
    text,
)
