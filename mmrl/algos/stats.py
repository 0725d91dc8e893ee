"""Masked statistics over response steps, and the entropy of a categorical policy.

Masked entries never leak into a result, not even inf or NaN: they are selected
out before any sum.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` where ``mask`` is 1.

    values: [...] any shape.
    mask: same shape as ``values``, 0/1 (bool or float).
    dim: reduce over this dim, or over everything when None.
    Returns the mean; 0 where nothing is unmasked. Masked entries never leak
    (not even inf/NaN), because they are selected out before summing.
    """
    keep = mask.bool()
    total = torch.where(keep, values, torch.zeros_like(values))
    count = keep.to(values.dtype)
    if dim is None:
        return total.sum() / count.sum().clamp(min=1)
    return total.sum(dim) / count.sum(dim).clamp(min=1)


def masked_var(values: Tensor, mask: Tensor) -> Tensor:
    """Unbiased variance (like ``torch.var``) of ``values`` [...] over ``mask`` [...] == 1.

    Returns a scalar; 0 when fewer than two entries are unmasked.
    """
    keep = mask.bool()
    mean = masked_mean(values, keep)
    dev = torch.where(keep, values - mean, torch.zeros_like(values))
    n = keep.sum()
    return (dev**2).sum() / (n - 1).clamp(min=1)


def masked_whiten(
    values: Tensor, mask: Tensor, shift_mean: bool = True, epsilon: float = 1e-8
) -> Tensor:
    """Whiten ``values`` [...] with the mean and unbiased variance over ``mask`` [...] == 1.

    Returns a tensor shaped like ``values``: ``(values - mean) / sqrt(var + epsilon)``
    (the mean is added back when ``shift_mean`` is False) and 0 outside ``mask``.
    """
    keep = mask.bool()
    mean = masked_mean(values, keep)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, keep) + epsilon)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(keep, whitened, torch.zeros_like(whitened))


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)``: ``logsumexp(z) - sum_v p_v z_v``.

    logits: [..., V] finite logits. Returns [...].
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
