"""A key/value cache that appends in place.

transformers' ``DynamicCache`` appends a decoding step by concatenating it to the whole
cache, so every step copies every cached key and value of every layer: over a response of
T tokens the copies grow as T squared. On a world model's responses (4 frames of 64 tokens
after a 136-token prompt) those copies took a third of the sampling time on a CPU.
:class:`GrowingCache` keeps each layer's keys and values in a buffer with room to spare,
writes a step into it, and hands attention a view of the filled part; the buffer doubles
when it is full, so the copies are amortised. :func:`decoding_cache` keeps it in fp32 on a
CPU whatever the model computes in: a bf16 model's keys and values convert exactly, and its
one-query steps then attend in fp32 without a conversion per step
(:mod:`mmrl.models.decode_attention`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from mmrl.models.decode_attention import cpu_decode_attention

# Below this many positions concatenating is cheaper: attention reads a view of the buffer
# more slowly than a compact tensor, and the addition task's responses (at most 32 tokens)
# decoded 11-20% slower in place; at 256 tokens the in-place cache decodes 1.2-1.3x faster,
# and a world model's 200-400-token sequences 1.1-1.6x (docs/scaling.md).
LONG_SEQUENCE = 192


class GrowingLayer(DynamicLayer):
    """One layer's keys and values ``[B, heads, length, head_dim]``, views of a buffer of
    ``capacity >= length`` positions, held in ``dtype`` (None: the keys' own)."""

    def __init__(self, capacity: int = 256, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.capacity, self.length, self.dtype_held = capacity, 0, dtype
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self.key_buffer is None or end > self.key_buffer.shape[-2]:
            self._reserve(key_states, value_states, max(end, 2 * self.length, self.capacity))
        self.key_buffer[..., self.length : end, :] = key_states
        self.value_buffer[..., self.length : end, :] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.key_buffer is not None:
            self.key_buffer = self.key_buffer[indices]
            self.value_buffer = self.value_buffer[indices]
            self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.key_buffer is not None:
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._view()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:  # transformers' legacy form: the length to keep
            tokens_to_remove = max(self.length - tokens_to_remove, 0)
        self.length = max(self.length - abs(tokens_to_remove), 0)
        if self.key_buffer is not None:
            self._view()

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        self.length = 0
        super().reset()

    def _reserve(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        batch, heads, _, dim = keys.shape
        dtype = self.dtype_held or keys.dtype
        key_buffer = keys.new_empty(batch, heads, capacity, dim, dtype=dtype)
        value_buffer = values.new_empty(
            batch, values.shape[1], capacity, values.shape[-1], dtype=dtype
        )
        if self.length:
            key_buffer[..., : self.length, :] = self.keys
            value_buffer[..., : self.length, :] = self.values
        self.key_buffer, self.value_buffer = key_buffer, value_buffer

    def _view(self) -> None:
        self.keys = self.key_buffer[..., : self.length, :]
        self.values = self.value_buffer[..., : self.length, :]


class GrowingCache(DynamicCache):
    """``DynamicCache`` with :class:`GrowingLayer` layers: appending a step costs that step,
    not the cache. Room for ``capacity`` positions is reserved on the first write."""

    def __init__(
        self, num_layers: int, capacity: int = 256, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.layers = [GrowingLayer(capacity, dtype) for _ in range(num_layers)]
        self.layer_class_to_replicate = None


@contextmanager
def decoding_cache(model: torch.nn.Module, capacity: int) -> Iterator[DynamicCache]:
    """The cache to decode ``model`` with, for sequences of up to ``capacity`` positions.

    Long sequences whose layers all attend to the whole sequence get a :class:`GrowingCache`,
    and within the block their one-query steps in bf16 or fp16 on a CPU take
    :func:`~mmrl.models.decode_attention.one_query_attention` (torch's SDPA is slow there).
    Anything else gets transformers' own cache and attention.
    """
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None) or ["full_attention"]
    if capacity < LONG_SEQUENCE or any(t != "full_attention" for t in types):
        yield DynamicCache(config=model.config)
        return
    on_cpu = next(model.parameters()).device.type == "cpu"
    with cpu_decode_attention(model):
        yield GrowingCache(config.num_hidden_layers, capacity, torch.float32 if on_cpu else None)
