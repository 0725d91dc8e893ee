"""Turning sampled token ids into a rollout Batch: responses, masks, log-probs, positions."""

from __future__ import annotations

import torch

from mmrl.models.vlm_inputs import extend_position_ids
from mmrl.protocol import Batch


def generated_responses(
    sequences: torch.Tensor,
    scores: tuple[torch.Tensor, ...],
    prompt_len: int,
    max_tokens: int,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses [B, max_tokens] and their sampling log-probs from a transformers ``generate``.

    ``scores`` are the processed logits actually sampled from (temperature, top-k/top-p
    and constraints applied), so their log-softmax is the sampling log-prob. When every
    row stopped early, both are right-padded to a fixed width.
    """
    responses = sequences[:, prompt_len:]
    log_probs = torch.log_softmax(torch.stack(scores, dim=1).float(), dim=-1)
    log_probs = log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    pad = max_tokens - responses.shape[1]
    if pad > 0:
        responses = torch.nn.functional.pad(responses, (0, pad), value=pad_id)
        log_probs = torch.nn.functional.pad(log_probs, (0, pad), value=0.0)
    return responses, log_probs


def finish_rollout(
    prompts: Batch, responses: torch.Tensor, log_probs: torch.Tensor, eos_ids: set[int], pad_id: int
) -> Batch:
    """Mask everything after the first stop token and append responses to the prompts.

    Position ids continue after the prompt (:func:`extend_position_ids`): [B, P] for 1-D
    rope, [B, 3, P] for mrope. Non-tensor fields (``multi_modal_inputs``, ...) are carried
    by reference: the result's object arrays are new, their elements the prompts' own.

    Args:
        prompts: left-padded prompt batch, ``input_ids`` [B, P].
        responses: sampled token ids [B, T], any content after the stop token.
        log_probs: log-prob of each sampled token [B, T].
    """
    is_stop = torch.zeros_like(responses, dtype=torch.bool)
    for eos in eos_ids:
        is_stop |= responses == eos
    # A step is valid while no stop token came strictly before it.
    stops_before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()
    response_mask = (stops_before == 0).to(torch.float32)
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_id))
    # where(), not a product: a masked-out step may hold -inf (disallowed token after EOS).
    log_probs = torch.where(response_mask.bool(), log_probs, torch.zeros_like(log_probs))
    clipped = ~is_stop.any(dim=1)

    out = Batch(
        prompts.tensors.clone(),
        {k: v.copy() for k, v in prompts.non_tensor.items()},
        dict(prompts.meta),
    )
    out["input_ids"] = torch.cat([prompts["input_ids"], responses], dim=1)
    out["attention_mask"] = torch.cat([prompts["attention_mask"], response_mask.long()], dim=1)
    out["position_ids"] = extend_position_ids(prompts["position_ids"], responses.shape[1])
    out["responses"] = responses
    out["response_mask"] = response_mask
    out["rollout_log_probs"] = log_probs
    out["response_clipped"] = clipped
    out.meta["num_clipped"] = int(clipped.sum())
    return out
