"""Attention for one-token decoding steps of a bf16 (or fp16) model on the CPU.

A decoding step attends one query per row to the row's cached keys. torch's CPU SDPA kernels
are slow at that shape in bf16: in a world model's GRPO rollouts (128 rows, 136-token
prompts, 259-token responses) attention took 57% of the sampling time. :func:`one_query_attention`
computes those steps as two batched matrix products and a softmax in fp32, reading the fp32
keys and values of :class:`~mmrl.models.kv_cache.GrowingCache`; fp32 models, prompt passes,
training and GPUs keep transformers' SDPA path (docs/scaling.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "mmrl_cpu_decode"


def one_query_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query [B, H, 1, D]`` against ``key``/``value``
    ``[B, H_kv, L, D]`` (query heads grouped over key/value heads as ``repeat_kv`` groups them),
    ``attention_mask`` boolean (True: attend) or additive, broadcastable to ``[B, 1, 1, L]``;
    returns ``[B, 1, H, D]`` in the query's dtype. Anything else goes to SDPA."""
    fp32 = query.dtype == torch.float32  # SDPA is as fast there
    if fp32 or query.shape[2] != 1 or query.device.type != "cpu" or torch.is_grad_enabled():
        key, value = key.to(query.dtype), value.to(query.dtype)  # a cache may hold fp32
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim).float()
    scores = torch.matmul(grouped, key.float().transpose(-1, -2))  # [B, H_kv, groups, L]
    scores = scores * (dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None:
        mask = attention_mask.reshape(attention_mask.shape[0], 1, 1, -1)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    out = torch.matmul(torch.softmax(scores, dim=-1), value.float())  # [B, H_kv, groups, D]
    return out.reshape(batch, 1, heads, dim).to(query.dtype), None


AttentionInterface.register(NAME, one_query_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextmanager
def cpu_decode_attention(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s SDPA attention computes one-query steps on the CPU with
    :func:`one_query_attention`; the model is left as it was after it."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
