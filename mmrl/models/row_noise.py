"""Per-row noise for latent-space rollouts.

Token engines seed each row from the batch's ``sample_seeds`` field, which the trainer draws
over the whole batch before the worker group splits it. A latent or flow rollout that drew
its noise from one generator per call would instead give each rank's first row the same
noise as rank 0's, and a row's sample would change with the worker count. :class:`RowNoise`
keeps one generator per row, seeded by that row's seed, so a row draws the same noise
wherever it is sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmrl.sampling import SamplingParams, prompt_row_seeds


class RowNoise:
    """One CPU generator per batch row; ``seeds=None`` seeds each from the OS."""

    def __init__(self, seeds: Sequence[int] | None, rows: int):
        if seeds is not None and len(seeds) != rows:
            raise ValueError(f"{len(seeds)} row seeds for {rows} rows")
        self.generators = [torch.Generator() for _ in range(rows)]
        for row, generator in enumerate(self.generators):
            if seeds is None:
                generator.seed()
            else:
                generator.manual_seed(int(seeds[row]))

    @classmethod
    def for_rollout(cls, prompts: Any, sampling: SamplingParams) -> RowNoise:
        """The rows' generators of a rollout of ``prompts`` (see ``prompt_row_seeds``)."""
        return cls(prompt_row_seeds(prompts, sampling), len(prompts))

    def randn(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Standard normal noise ``[rows, *shape]``, row ``i`` from generator ``i``."""
        return torch.stack([torch.randn(shape, generator=g, dtype=dtype) for g in self.generators])


def standard_normal(
    shape: Sequence[int],
    source: torch.Generator | RowNoise | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``N(0, I)`` noise of ``shape`` on the CPU: per row from a :class:`RowNoise` (whose row
    count must be ``shape[0]``), else from one generator (or the global one)."""
    if isinstance(source, RowNoise):
        if len(source.generators) != shape[0]:
            raise ValueError(f"noise for {shape[0]} rows from {len(source.generators)} generators")
        return source.randn(shape[1:], dtype)
    return torch.randn(shape, generator=source, dtype=dtype)
