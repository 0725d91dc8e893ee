"""Which scaled-dot-product attention kernel a training forward pass runs on the CPU."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def training_attention(
    seq_len: int, device: torch.device, max_len: int
) -> AbstractContextManager[None]:
    """torch's math attention kernel for a forward pass that keeps a graph, on the CPU, over
    sequences of at most ``max_len`` tokens; torch's own choice (flash) otherwise.

    On the CPU the flash kernel's backward has a large fixed cost: for 36 rows of 38 tokens
    and 12 heads, forward and backward took 28 ms per layer with flash against 12 ms with
    the math kernel (bf16; 15 against 12 ms in fp32), while from about 256 tokens flash is
    faster and the math kernel's ``L x L`` scores start to cost memory (docs/scaling.md).
    """
    if device.type != "cpu" or not torch.is_grad_enabled() or seq_len > max_len:
        return nullcontext()
    return sdpa_kernel([SDPBackend.MATH])
