"""Packing a token micro-batch's rows end to end, without padding (verl's use_remove_padding).

Rows padded to the micro-batch's longest row spend the forward pass on every padding slot.
Packing lays each row's real tokens end to end into bins as long as that longest row (first
fit, longest row first). Position ids restart at 0 for every sequence, and from them
transformers builds the packed-sequence attention mask: a token attends to its own
sequence's earlier tokens only, as in its padded row. A bin costs no more attention than a
padded row, and the linear layers run on the real tokens (plus the bins' unfilled tails).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from mmrl.protocol import Batch


@dataclass
class PackedRows:
    """``input_ids`` and ``position_ids`` [k, W]: the packed bins. ``score_index`` [n]: where
    in the flattened bins [k * W] sits the token whose logits score each real response step,
    in the order of ``steps`` [b, T] (bool: the response steps with a real token)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    score_index: torch.Tensor
    steps: torch.Tensor


def first_fit_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Row ids in bins whose lengths add up to at most ``capacity``, longest row first."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        slot = next((i for i, free in enumerate(room) if free >= lengths[row]), None)
        if slot is None:
            bins.append([])
            room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(row)
        room[slot] -= lengths[row]
    return bins


def positions_count_tokens(batch: Batch) -> bool:
    """Whether ``batch``'s position ids count 0, 1, 2, ... along each row's real tokens, so
    that a row's tokens keep their positions wherever they are laid."""
    mask = batch["attention_mask"].bool()
    positions = batch["position_ids"]
    if positions.shape != mask.shape:
        return False
    return torch.equal(positions[mask], (mask.long().cumsum(-1) - 1)[mask])


def pack_rows(batch: Batch) -> PackedRows | None:
    """``batch`` (``input_ids``, ``attention_mask``, ``position_ids`` [b, P + T] with left-padded
    prompts and right-padded responses) packed into bins; ``None`` when its position ids do
    not count 0, 1, 2, ... along each row's real tokens (3-D rope positions, offsets), which
    the packed-sequence mask could not tell apart."""
    if not positions_count_tokens(batch):
        return None
    mask = batch["attention_mask"].bool()
    device = mask.device
    lengths = mask.sum(-1).tolist()
    width = max(lengths)
    bins = first_fit_bins(lengths, width)
    tokens = batch["input_ids"]
    # Each bin's unfilled tail (token 0) counts from 0 too: a sequence of its own, which no
    # real token attends to.
    input_ids = torch.zeros((len(bins), width), dtype=tokens.dtype, device=device)
    position_ids = torch.arange(width, device=device).repeat(len(bins), 1)
    row_start = [0] * len(lengths)
    for b, rows in enumerate(bins):
        offset = 0
        for row in rows:
            end = offset + lengths[row]
            input_ids[b, offset:end] = tokens[row][mask[row]]
            position_ids[b, offset:end] = torch.arange(lengths[row], device=device)
            row_start[row] = b * width + offset
            offset = end
        position_ids[b, offset:] = torch.arange(width - offset, device=device)
    steps_width = batch["responses"].shape[1]
    prompt_lengths = mask[:, : mask.shape[1] - steps_width].sum(-1)
    steps = mask[:, -steps_width:]
    # The logit at a token predicts the next one: step t is scored at the token before it.
    start = torch.tensor(row_start, device=device) + prompt_lengths - 1
    index = start[:, None] + torch.arange(steps_width, device=device)
    return PackedRows(input_ids, position_ids, index[steps], steps)


@contextmanager
def head_on_positions(head: nn.Module, index: torch.Tensor) -> Iterator[None]:
    """Inside the block, ``head`` (the LM head) runs on the flattened positions ``index`` of
    its input [k, W, H] alone, as [1, n, H]: no logits for the other tokens."""

    def gather(_module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        return (hidden.reshape(1, -1, hidden.shape[-1])[:, index], *args[1:])

    handle = head.register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()
