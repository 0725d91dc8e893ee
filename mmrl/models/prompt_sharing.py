"""Running a GRPO group's shared prompt once in a training forward pass.

A GRPO batch holds each prompt n times, once per sampled response, and a packed forward
pass (:mod:`mmrl.models.packing`) still runs the prompt's tokens n times. Here the rows
that share a prompt become one sequence: the prompt, then each response in turn. An
attention mask lets a response's tokens see the prompt and the earlier tokens of their own
response only, and a response's positions continue from the prompt's end, so every token
sees exactly what it sees in its own row. The prompt's hidden states, and in the backward
pass its gradients, are computed once and shared, as the rows' sum.

A sequence's attention costs the square of its length, so a group's responses are split
over several sequences when they would make one longer than ``width`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmrl.models.packing import positions_count_tokens
from mmrl.protocol import Batch


@dataclass
class SharedPromptRows:
    """``input_ids``, ``position_ids`` [k, W] and ``attention_mask`` [k, 1, W, W] (bool,
    True: may attend): the sequences. ``score_index`` [n]: where in the flattened sequences
    [k * W] sits the token whose logits score each real response step, in the order of
    ``steps`` [b, T] (bool: the response steps with a real token)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    score_index: torch.Tensor
    steps: torch.Tensor


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Row ids grouped by identical prompt (the real tokens), in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, (ids, real) in enumerate(zip(prompt_ids.tolist(), prompt_mask.tolist(), strict=True)):
        key = tuple(token for token, keep in zip(ids, real, strict=True) if keep)
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def split_by_width(
    rows: list[int], lengths: list[int], prompt_len: int, width: int
) -> list[list[int]]:
    """``rows`` (responses of ``lengths``) in consecutive runs that fit after the prompt in
    ``width`` tokens (a run holds at least one row), as few as fit and of about equal length:
    the sequences are padded to the longest, so a long run beside a short one costs two long
    ones."""
    room = max(1, width - prompt_len)
    total = sum(lengths[row] for row in rows)
    share = total / max(1, -(-total // room))  # per run, for the fewest runs that fit
    runs: list[list[int]] = [[]]
    used = run_used = 0
    for row in rows:
        past_share = used + lengths[row] / 2 > share * len(runs)
        if runs[-1] and (past_share or run_used + lengths[row] > room):
            runs.append([])
            run_used = 0
        runs[-1].append(row)
        used += lengths[row]
        run_used += lengths[row]
    return runs


def shared_prompt_rows(
    batch: Batch, width_factor: float = 4.0, max_token_share: float = 0.5
) -> SharedPromptRows | None:
    """``batch`` (``input_ids``, ``attention_mask``, ``position_ids`` [b, P + T] with
    left-padded prompts and right-padded responses) as sequences that hold each prompt once;
    ``None`` when the sequences would hold more than ``max_token_share`` of the rows' tokens
    (the longer attention then costs more than the shorter linear layers save: six-token
    prompts before twenty-token responses ran slower shared), or when the position ids do
    not count 0, 1, 2, ... along each row's real tokens. A sequence is at most
    ``width_factor`` times the batch's longest row long (unless one prompt and one response
    make it longer)."""
    if not positions_count_tokens(batch):
        return None
    mask = batch["attention_mask"].bool()
    num_steps = batch["responses"].shape[1]
    num_prompt = mask.shape[1] - num_steps
    tokens = batch["input_ids"]
    groups = prompt_groups(tokens[:, :num_prompt], mask[:, :num_prompt])
    steps = mask[:, num_prompt:]
    response_lengths = steps.sum(-1).tolist()
    prompt_lengths = mask[:, :num_prompt].sum(-1).tolist()
    width = int(
        width_factor * max(p + r for p, r in zip(prompt_lengths, response_lengths, strict=True))
    )
    sequences = []  # (prompt row, response rows)
    for rows in groups:
        for run in split_by_width(rows, response_lengths, prompt_lengths[rows[0]], width):
            sequences.append((rows[0], run))
    lengths = [prompt_lengths[p] + sum(response_lengths[r] for r in run) for p, run in sequences]
    if sum(lengths) > max_token_share * (sum(prompt_lengths) + sum(response_lengths)):
        return None
    seq_width = max(lengths)
    device = tokens.device
    input_ids = torch.zeros((len(sequences), seq_width), dtype=tokens.dtype, device=device)
    position_ids = torch.zeros((len(sequences), seq_width), dtype=torch.long, device=device)
    # 0: the prompt; i: the i-th response (from 1); -1: the unused tail.
    segment = torch.full((len(sequences), seq_width), -1, dtype=torch.long, device=device)
    # Flattened indices of each row's first response token and of its prompt's last token.
    response_start, prompt_last = [0] * len(tokens), [0] * len(tokens)
    for s, (prompt_row, run) in enumerate(sequences):
        prompt_len = prompt_lengths[prompt_row]
        input_ids[s, :prompt_len] = tokens[prompt_row, :num_prompt][mask[prompt_row, :num_prompt]]
        position_ids[s, :prompt_len] = torch.arange(prompt_len, device=device)
        segment[s, :prompt_len] = 0
        offset = prompt_len
        for i, row in enumerate(run, start=1):
            end = offset + response_lengths[row]
            input_ids[s, offset:end] = tokens[row, num_prompt:][steps[row]]
            position_ids[s, offset:end] = torch.arange(
                prompt_len, prompt_len + end - offset, device=device
            )
            segment[s, offset:end] = i
            response_start[row] = s * seq_width + offset
            prompt_last[row] = s * seq_width + prompt_len - 1
            offset = end
    causal = torch.ones(seq_width, seq_width, dtype=torch.bool, device=device).tril()
    query, key = segment[:, :, None], segment[:, None, :]
    attention_mask = (causal & ((key == 0) | (key == query)))[:, None]
    # The logit at a token predicts the next one: step t is scored at the response's token
    # t - 1, and step 0 at the prompt's last token.
    index = torch.tensor(response_start, device=device)[:, None] - 1
    index = index + torch.arange(num_steps, device=device)
    index[:, 0] = torch.tensor(prompt_last, device=device)
    return SharedPromptRows(input_ids, position_ids, attention_mask, index[steps], steps)
