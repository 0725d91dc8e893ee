"""Importing this module registers the built-in verifiers."""

from mmrl.verifiers import closed_loop, image, lpips, reasoning, state_match, text  # noqa: F401
