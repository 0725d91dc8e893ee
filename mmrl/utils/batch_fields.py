"""Checks and row indexing of a Batch's per-sample fields."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

Index = int | slice | torch.Tensor | np.ndarray | Sequence[int] | Sequence[bool]


def field_length(name: str, value: Any) -> int:
    if isinstance(value, torch.Tensor | np.ndarray) and value.ndim == 0:
        raise ValueError(f"{name} is a 0-d {type(value).__name__}; expected a leading batch dim")
    if isinstance(value, str | bytes | Mapping) or not hasattr(value, "__len__"):
        raise TypeError(
            f"{name} must be a Tensor, np.ndarray or list with one entry per sample, found "
            f"{type(value).__name__}"
        )
    return len(value)


def as_object_array(key: str, values: np.ndarray | Sequence[Any]) -> np.ndarray:
    """A 1-D object array [B]; element-wise assignment keeps list-of-lists from becoming 2-D."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    out = np.empty(field_length(f"non_tensor {key!r}", values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def normalize_index(index: Index, n: int) -> slice | np.ndarray:
    """Rows as a slice (keeps torch views) or an int64 array of non-negative row ids."""
    if isinstance(index, int | np.integer) and not isinstance(index, bool | np.bool_):
        if not -n <= index < n:
            raise IndexError(f"row {index} is out of range for a Batch of {n} rows")
        return slice(index % n, index % n + 1)
    if isinstance(index, slice) and (index.step or 1) > 0:
        return index
    if isinstance(index, slice):  # torch tensors cannot take negative-step slices
        return np.arange(n)[index].copy()
    rows = np.asarray(index.detach().cpu() if isinstance(index, torch.Tensor) else index)
    if rows.dtype == bool:
        if rows.shape != (n,):
            raise IndexError(f"boolean mask has shape {rows.shape}, expected ({n},)")
        return np.flatnonzero(rows)
    if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
        raise IndexError(
            f"row index must be 1-D integers or a bool mask, found {rows.dtype} {rows.shape}"
        )
    rows = rows.astype(np.int64)
    if rows.size and (rows.min() < -n or rows.max() >= n):
        raise IndexError(
            f"row index out of range for a Batch of {n} rows: min {rows.min()}, max {rows.max()}"
        )
    return np.where(rows < 0, rows + n, rows)


def check_keys(kind: str, keys: Sequence[str] | None, available: Any) -> list[str]:
    """``keys`` (all of ``available`` when None) after checking that each exists."""
    if keys is None:
        return list(available)
    missing = [k for k in keys if k not in available]
    if missing:
        raise KeyError(f"unknown {kind} keys {missing}; available: {list(available)}")
    return list(keys)


def values_equal(a: Any, b: Any) -> bool:
    """Structural equality for tensors, arrays and nested non-tensor values; NaN equals NaN."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor | np.ndarray) or isinstance(b, torch.Tensor | np.ndarray):
        if type(a) is not type(b) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        if isinstance(a, torch.Tensor):
            b = b.to(a.device)
            if a.is_floating_point():
                return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
            return torch.equal(a, b)
        if a.dtype == object:
            return all(map(values_equal, a.ravel(), b.ravel()))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(values_equal, a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)
