"""Sampling inside transformers ``generate`` with one random stream per row.

``generate`` draws every row's token from one global generator, so what a row samples
depends on which rows share its call. :class:`RowSeededSampler` draws each row's token
itself, by inverse CDF from that row's own uniforms, and leaves ``generate`` a one-hot
choice to take greedily. A response then depends on its row's seed alone, and a run split
over any number of ranks samples what one worker samples.
"""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mmrl.sampling import SamplingParams, prompt_row_seeds, row_seeds


class RowSeededSampler(LogitsProcessor):
    """The last processor: samples each row from the scores it receives (all restrictions and
    warpers applied) and returns a one-hot -inf mask at the sampled token.

    ``uniforms`` [B, T] hold row b's draw for step t. The scores each step sampled from are
    kept in ``scores`` (their log-softmax is the sampling log-prob).
    """

    def __init__(self, uniforms: torch.Tensor) -> None:
        self.uniforms = uniforms
        self.scores: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = len(self.scores)
        self.scores.append(scores)
        probs = torch.softmax(scores.float(), dim=-1)
        cdf = probs.cumsum(-1)
        # Scaled by the total so a draw never lands past the last token with mass; "right"
        # never picks a token of zero probability (its CDF equals its predecessor's).
        u = self.uniforms[:, step : step + 1].to(cdf.device) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u, right=True).clamp(max=scores.shape[-1] - 1)
        chosen = torch.full_like(scores, float("-inf"))
        chosen.scatter_(1, tokens, 0.0)
        return chosen


def row_uniforms(seeds: list[int], steps: int) -> torch.Tensor:
    """[len(seeds), steps]: each row's uniform draws, from a generator seeded by its seed."""
    draws = [torch.rand(steps, generator=torch.Generator().manual_seed(s)) for s in seeds]
    return torch.stack(draws)


def seeded_sampling_processors(
    prompts, sampling: SamplingParams
) -> tuple[LogitsProcessorList, RowSeededSampler]:
    """Temperature, top-k and top-p as ``generate`` would apply them when sampling, then the
    row-seeded draw (:func:`~mmrl.sampling.prompt_row_seeds`; fresh seeds without a seed).
    Run ``generate`` greedily with no warpers of its own: these replace them."""
    seeds = prompt_row_seeds(prompts, sampling)
    if seeds is None:
        seeds = row_seeds(int(torch.randint(2**62, ())), len(prompts)).tolist()
    warpers = LogitsProcessorList()
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
    sampler = RowSeededSampler(row_uniforms(seeds, sampling.max_tokens))
    warpers.append(sampler)
    return warpers, sampler
