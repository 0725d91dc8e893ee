"""Dropping the padding columns that no row of a token batch uses.

A rollout Batch is laid out at a fixed width: prompts left-padded to
``data.max_prompt_length``, responses right-padded to ``data.max_response_length``. A
forward pass costs the same for a padding column as for a real one, so a micro-batch runs
cheapest at its own longest prompt and response. The columns dropped are masked out of
attention in every row, and ``position_ids`` are carried, not recomputed, so the kept
positions compute the same values (up to floating-point rounding of the smaller matmuls).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmrl.protocol import Batch

# Tensors laid out [prompt | response] along their last dimension.
SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")


def trim_padding(batch: Batch) -> Batch:
    """``batch`` cut to the prompt columns some row attends to and the response steps some row
    has.

    Sequence tensors (``input_ids``, ``attention_mask`` [b, P + T], ``position_ids``
    [b, P + T] or [b, 3, P + T]) lose their leading all-padding columns and their trailing
    response steps beyond the longest response; every other [b, T] tensor (``responses``,
    ``response_mask``, ``advantages``, ``old_log_probs``, ...) keeps its first T' steps.
    Non-tensor fields and ``meta`` are shared with ``batch``. A batch without
    ``attention_mask`` or ``response_mask`` is returned as it is.
    """
    if "attention_mask" not in batch or "response_mask" not in batch:
        return batch
    mask = batch["response_mask"]
    steps = mask.shape[1]
    prompt_width = batch["attention_mask"].shape[1] - steps
    used = mask.any(0).nonzero()
    used_steps = int(used.max()) + 1 if len(used) else 1
    used_prompt = batch["attention_mask"][:, :prompt_width].any(0)
    first = int(used_prompt.nonzero().min()) if used_prompt.any() else prompt_width - 1
    if first == 0 and used_steps == steps:
        return batch
    end = prompt_width + used_steps
    tensors = {}
    for key, value in batch.tensors.items():
        if key in SEQUENCE_KEYS:
            tensors[key] = value[..., first:end]
        elif value.ndim >= 2 and value.shape[1] == steps:
            tensors[key] = value[:, :used_steps]
        else:
            tensors[key] = value
    return Batch.from_dict(tensors=tensors, non_tensor=dict(batch.non_tensor), meta=batch.meta)


def pad_steps(values: torch.Tensor, steps: int) -> torch.Tensor:
    """[b, T'] per-step values right-padded with zeros to [b, ``steps``]."""
    return F.pad(values, (0, steps - values.shape[1]))
