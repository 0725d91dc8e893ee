"""Token-by-token sampling for a causal LM that stops computing the rows that have finished.

transformers' ``generate`` runs every row through the model until the last row stops: in a
GRPO batch one long response keeps the whole batch decoding. :func:`decode_rows` drops a
row from the forward pass (and its key/value cache) as soon as it emits a stop token. What
it returns is what greedy ``generate`` with the same logits processors returns: the
processors still see the whole batch, finished rows with pad tokens, so a processor's
per-row state (row seeds, teacher-forced tokens) keeps its meaning.

A GRPO batch holds each prompt once per sample: the prompt pass runs each distinct prompt
once, and its keys and values are copied to the rows that share it. The cache of a long
sequence appends each step in place (:mod:`mmrl.models.kv_cache`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LogitsProcessorList

from mmrl.models.kv_cache import decoding_cache
from mmrl.models.prompt_sharing import prompt_groups


@torch.no_grad()
def decode_rows(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    processors: LogitsProcessorList,
    max_new_tokens: int,
    stop_ids: set[int],
    pad_id: int,
    min_new_tokens: int = 0,
    keep_scores: bool = True,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Tokens [B, P + t] (the prompts, then t <= ``max_new_tokens`` steps: the loop ends when
    every row has stopped) and the processed scores [B, V] of each step.

    Each step takes the highest processed score, as greedy ``generate`` does: sampling is the
    processors' business (:class:`~mmrl.models.row_sampling.RowSeededSampler`). Until
    ``min_new_tokens`` steps are out, stop tokens get no score (``generate``'s
    ``min_new_tokens``). A row's steps after its stop token are ``pad_id``. ``input_ids`` is
    left-padded; positions count its real tokens from 0. Without ``keep_scores`` the list is
    empty (a sampler that keeps its own scores spares a [B, V] copy per step).
    """
    with decoding_cache(model, input_ids.shape[1] + max_new_tokens) as cache:
        batch = input_ids.shape[0]
        stops = torch.tensor(sorted(stop_ids), device=input_ids.device)
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        first, copies = distinct_rows(input_ids, attention_mask)
        logits = model(
            input_ids=input_ids[first],
            attention_mask=attention_mask[first],
            position_ids=positions[first],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        if len(first) < batch:
            cache.batch_select_indices(copies)
            logits = logits[copies]
        live = torch.arange(batch, device=input_ids.device)  # the rows the cache holds, in order
        mask, position = attention_mask, positions[:, -1:]
        done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        sequences, scores = input_ids, []
        for step in range(max_new_tokens):
            step_scores = logits.new_zeros(batch, logits.shape[-1], dtype=torch.float32)
            step_scores[live] = logits.float()
            if step < min_new_tokens:
                step_scores[:, stops] = float("-inf")
            step_scores = processors(sequences, step_scores)
            tokens = torch.where(done, pad_id, step_scores.argmax(-1))
            if keep_scores:
                scores.append(step_scores)
            sequences = torch.cat([sequences, tokens[:, None]], dim=1)
            done |= torch.isin(tokens, stops)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            keep = (~done[live]).nonzero().squeeze(-1)
            if len(keep) < len(live):
                cache.batch_select_indices(keep)
                live, mask, position = live[keep], mask[keep], position[keep]
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
            position = position + 1
            logits = model(
                input_ids=tokens[live, None],
                attention_mask=mask,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
        return sequences, scores


def distinct_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first row of each distinct prompt, in order, and for each row the position of its
    prompt among them: ``input_ids[first][copies]`` is ``input_ids`` (left-padded alike)."""
    groups = prompt_groups(input_ids, attention_mask)
    first = torch.tensor([rows[0] for rows in groups], device=input_ids.device)
    copies = torch.empty(len(input_ids), dtype=torch.long, device=input_ids.device)
    for i, rows in enumerate(groups):
        copies[rows] = i
    return first, copies
