"""Batch: the one data container passed between the stages of an RL step.

A Batch of ``B`` samples holds three kinds of data:

- ``tensors``: a ``TensorDict`` with ``batch_size=[B]``. Every tensor has ``B`` rows;
  the remaining dims may differ per key (``input_ids [B, T]``, ``pixel_values [B, C, H, W]``).
- ``non_tensor``: 1-D numpy object arrays of length ``B`` for per-sample Python values
  (``uid``, ``ground_truth``, ``multi_modal_inputs``, ``extra_info``, ...).
- ``meta``: batch-level values (sampling params, metrics, ...), never indexed.

Row selection (indexing, split, chunk, repeat, padding) applies to ``tensors`` and
``non_tensor`` alike, so a sample's fields never drift apart. ``save``/``load`` use
safetensors plus JSON; nothing is pickled.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from mmrl.utils.batch_io import read_batch, write_batch

Index = int | slice | torch.Tensor | np.ndarray | Sequence[int] | Sequence[bool]


class Batch:
    """``B`` samples as ``tensors`` (TensorDict, batch_size [B]), ``non_tensor`` (object arrays [B]) and ``meta``.

    ``batch["key"]`` returns a tensor or a non-tensor array. ``batch[i]`` with an int, slice,
    index array/tensor or bool mask [B] returns a new Batch of those rows (an int gives a
    1-row Batch); ``batch.row(i)`` and iteration give per-sample dicts. Slices share tensor
    storage with the source, as in torch; use ``clone()`` for an independent copy.
    """

    def __init__(
        self,
        tensors: TensorDict,
        non_tensor: Mapping[str, np.ndarray | Sequence[Any]] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if tensors.batch_dims != 1:
            raise ValueError(
                f"tensors must have a 1-D batch_size [B], found {list(tensors.batch_size)}"
            )
        nested = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
        if nested:
            raise TypeError(f"tensors must be flat; keys {nested} do not hold a torch.Tensor")
        self.tensors = tensors
        self.non_tensor: dict[str, np.ndarray] = {}
        self.meta: dict[str, Any] = dict(meta or {})
        for key, values in (non_tensor or {}).items():
            self._set(key, values, is_tensor=False)

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensor: Mapping[str, np.ndarray | Sequence[Any]] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Batch:
        """Build a Batch whose length B is taken from the first field; every field must have B rows."""
        tensors, non_tensor = dict(tensors or {}), dict(non_tensor or {})
        bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(
                f"tensors {bad} are not torch.Tensor; pass other per-sample values as non_tensor"
            )
        fields = [(k, v, True) for k, v in tensors.items()]
        fields += [(k, v, False) for k, v in non_tensor.items()]
        n = _length(f"field {fields[0][0]!r}", fields[0][1]) if fields else 0
        batch = cls(TensorDict({}, batch_size=[n]), meta=meta)
        for key, value, is_tensor in fields:
            batch._set(key, value, is_tensor)
        return batch

    # ----- access -----------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    @property
    def batch_size(self) -> int:
        return len(self)

    def keys(self) -> list[str]:
        """Tensor keys (non-tensor keys are ``list(batch.non_tensor)``)."""
        return list(self.tensors.keys())

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensor

    def __getitem__(self, index: str | Index) -> Any:
        if isinstance(index, str):
            if index in self.non_tensor:
                return self.non_tensor[index]
            if index in self.tensors:
                return self.tensors[index]
            raise KeyError(
                f"no field {index!r}; tensors {self.keys()}, non_tensor {list(self.non_tensor)}"
            )
        return self._take(_normalize_index(index, len(self)))

    def __setitem__(self, key: str, value: torch.Tensor | np.ndarray | Sequence[Any]) -> None:
        """Set a tensor field (Tensor) or a non-tensor field (array or list); either must have B rows."""
        self._set(key, value, is_tensor=isinstance(value, torch.Tensor))

    def _set(self, key: str, value: Any, is_tensor: bool) -> None:
        kind, other = ("tensor", "non_tensor") if is_tensor else ("non_tensor", "tensor")
        if key in (self.non_tensor if is_tensor else self.tensors):
            raise ValueError(
                f"cannot set {kind} {key!r}: it already names a {other} field; pop it first"
            )
        n = _length(f"{kind} {key!r}", value)
        if n != len(self):
            raise ValueError(
                f"{kind} {key!r} has length {n}, expected {len(self)} (the batch size)"
            )
        if is_tensor:
            self.tensors[key] = value
        else:
            self.non_tensor[key] = _as_object_array(key, value)

    def row(self, i: int) -> dict[str, Any]:
        """Sample ``i`` as ``{key: value}`` over tensor and non-tensor fields (meta excluded)."""
        i = _normalize_index(int(i), len(self)).start
        out: dict[str, Any] = {k: self.tensors[k][i] for k in self.keys()}
        out.update({k: v[i] for k, v in self.non_tensor.items()})
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self.row(i) for i in range(len(self)))

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{k}: {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            for k, t in self.tensors.items()
        )
        return (
            f"Batch(B={len(self)}, tensors={{{tensors}}}, "
            f"non_tensor={list(self.non_tensor)}, meta={list(self.meta)})"
        )

    # ----- row operations -----------------------------------------------------------

    def _take(self, index: slice | np.ndarray) -> Batch:
        rows = index if isinstance(index, slice) else torch.from_numpy(index)
        non_tensor = {k: v[index] for k, v in self.non_tensor.items()}
        return Batch(self.tensors[rows], non_tensor, self.meta)

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """Stack the rows of ``batches`` in order. All must have the same keys; meta comes from ``batches[0]``."""
        if not batches:
            raise ValueError("concat needs at least one Batch, found an empty list")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            for kind, ref, got in (
                ("tensor", first.keys(), b.keys()),
                ("non_tensor", first.non_tensor, b.non_tensor),
            ):
                if set(ref) != set(got):
                    raise ValueError(
                        f"concat: batch {i} and batch 0 differ in {kind} keys {sorted(set(ref) ^ set(got))}"
                    )
        tensors = {}
        for key in first.tensors.keys(include_nested=False):
            parts = [b.tensors[key] for b in batches]
            for i, t in enumerate(parts):
                if t.shape[1:] != parts[0].shape[1:] or t.dtype != parts[0].dtype:
                    raise ValueError(
                        f"concat: tensor {key!r} is {list(t.shape)} {t.dtype} in batch {i} but "
                        f"{list(parts[0].shape)} {parts[0].dtype} in batch 0; only dim 0 may differ"
                    )
            tensors[key] = torch.cat(parts)
        non_tensor = {
            k: np.concatenate([b.non_tensor[k] for b in batches]) for k in first.non_tensor
        }
        n = sum(len(b) for b in batches)
        return cls(TensorDict(tensors, batch_size=[n]), non_tensor, first.meta)

    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of ``size`` rows; the last may be smaller."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, found {size}")
        return [self[i : i + size] for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list[Batch]:
        """``n`` pieces of ``len(self) / n`` rows each; the length must divide evenly."""
        if n < 1:
            raise ValueError(f"chunk count must be >= 1, found {n}")
        if len(self) % n:
            raise ValueError(
                f"cannot chunk {len(self)} rows into {n} equal parts; "
                f"use batch.pad_to_divisor({n}) first and unpad(pad_size) afterwards"
            )
        size = len(self) // n
        return [self[i * size : (i + 1) * size] for i in range(n)]

    def pad_to_divisor(self, divisor: int) -> tuple[Batch, int]:
        """Append rows cycled from the start until the length divides by ``divisor``.

        Padded rows are copies of real samples (as verl does), so every stage can process
        them; drop them with ``unpad(pad_size)``. Returns ``(padded, pad_size)``; ``self``
        itself when no padding is needed.
        """
        if divisor < 1:
            raise ValueError(f"divisor must be >= 1, found {divisor}")
        pad_size = -len(self) % divisor
        if pad_size == 0:
            return self, 0
        if len(self) == 0:
            raise ValueError("cannot pad an empty Batch: there are no rows to repeat")
        return self._take(np.arange(len(self) + pad_size) % len(self)), pad_size

    def unpad(self, pad_size: int) -> Batch:
        """Drop the last ``pad_size`` rows added by ``pad_to_divisor``."""
        if not 0 <= pad_size <= len(self):
            raise ValueError(f"pad_size must be in [0, {len(self)}], found {pad_size}")
        return self[: len(self) - pad_size]

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Repeat every row ``n`` times: interleaved ``[a, a, b, b]`` or tiled ``[a, b, a, b]``."""
        if n < 1:
            raise ValueError(f"repeat count must be >= 1, found {n}")
        rows = np.arange(len(self))
        return self._take(np.repeat(rows, n) if interleave else np.tile(rows, n))

    def reorder(self, indices: torch.Tensor | np.ndarray | Sequence[int]) -> Batch:
        """Permute rows in place so that new row ``i`` is old row ``indices[i]``; returns ``self``."""
        index = _normalize_index(indices, len(self))
        if isinstance(index, slice) or not np.array_equal(np.sort(index), np.arange(len(self))):
            raise ValueError(
                f"reorder needs a permutation of range({len(self)}); the indices repeat or skip rows"
            )
        taken = self._take(index)
        self.tensors, self.non_tensor = taken.tensors, taken.non_tensor
        return self

    # ----- key operations -----------------------------------------------------------

    def union(self, other: Batch) -> Batch:
        """A new Batch with the keys of both; shared keys (and meta keys) must hold equal values."""
        if len(other) != len(self):
            raise ValueError(f"union: other has {len(other)} rows, expected {len(self)}")
        clash = set(self.keys()) & set(other.non_tensor) | set(self.non_tensor) & set(other.keys())
        if clash:
            raise ValueError(
                f"union: keys {sorted(clash)} are tensors in one Batch and non_tensor in the other"
            )
        for kind, mine, theirs in (
            ("tensor", self.tensors, other.tensors),
            ("non_tensor", self.non_tensor, other.non_tensor),
            ("meta", self.meta, other.meta),
        ):
            for key in set(mine.keys()) & set(theirs.keys()):
                if not _values_equal(mine[key], theirs[key]):
                    raise ValueError(
                        f"union: {kind} key {key!r} is in both Batches with different values"
                    )
        tensors = TensorDict(
            {**self.tensors.to_dict(), **other.tensors.to_dict()}, batch_size=[len(self)]
        )
        return Batch(tensors, {**self.non_tensor, **other.non_tensor}, {**self.meta, **other.meta})

    def select(
        self,
        tensor_keys: Sequence[str] | None = None,
        non_tensor_keys: Sequence[str] | None = None,
        meta_keys: Sequence[str] | None = None,
    ) -> Batch:
        """A new Batch with only these keys (None keeps every key of that kind). Values are shared, not copied."""
        return Batch(
            self.tensors.select(*_check_keys("tensor", tensor_keys, self.keys())),
            {
                k: self.non_tensor[k]
                for k in _check_keys("non_tensor", non_tensor_keys, self.non_tensor)
            },
            {k: self.meta[k] for k in _check_keys("meta", meta_keys, self.meta)},
        )

    def pop(
        self,
        tensor_keys: Sequence[str] = (),
        non_tensor_keys: Sequence[str] = (),
        meta_keys: Sequence[str] = (),
    ) -> Batch:
        """Remove these keys from ``self`` and return them as a new Batch of the same length."""
        popped = self.select(tensor_keys, non_tensor_keys, meta_keys)
        self.tensors = self.tensors.exclude(*tensor_keys)
        for key in non_tensor_keys:
            del self.non_tensor[key]
        for key in meta_keys:
            del self.meta[key]
        return popped

    def to(self, device: torch.device | str) -> Batch:
        """Move tensors to ``device``; non-tensor values stay where they are."""
        return Batch(self.tensors.to(device), self.non_tensor, self.meta)

    def clone(self) -> Batch:
        """A deep copy: tensors, non-tensor values and meta."""
        return Batch(self.tensors.clone(), copy.deepcopy(self.non_tensor), copy.deepcopy(self.meta))

    # ----- persistence --------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write ``<path>/tensors.safetensors`` and ``<path>/batch.json`` (no pickle).

        Non-tensor values and meta may nest str, int, float (NaN/inf included), bool, None,
        bytes, lists, tuples (loaded back as lists), dicts with str keys, numeric/bool
        numpy arrays and tensors. Numpy scalars load back as Python scalars and tensors
        load on CPU. Anything else raises TypeError naming the field and sample.
        """
        write_batch(path, dict(self.tensors.items()), self.non_tensor, self.meta, len(self))

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu") -> Batch:
        """Read a Batch written by ``save``; tensor fields are placed on ``device``."""
        tensors, non_tensor, meta, size = read_batch(path, device)
        return cls(TensorDict(tensors, batch_size=[size]), non_tensor, meta)


# ----- helpers ----------------------------------------------------------------------


def _length(name: str, value: Any) -> int:
    if isinstance(value, torch.Tensor | np.ndarray) and value.ndim == 0:
        raise ValueError(f"{name} is a 0-d {type(value).__name__}; expected a leading batch dim")
    if isinstance(value, str | bytes | Mapping) or not hasattr(value, "__len__"):
        raise TypeError(
            f"{name} must be a Tensor, np.ndarray or list with one entry per sample, found {type(value).__name__}"
        )
    return len(value)


def _as_object_array(key: str, values: np.ndarray | Sequence[Any]) -> np.ndarray:
    """A 1-D object array [B]; element-wise assignment keeps list-of-lists from becoming 2-D."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    out = np.empty(_length(f"non_tensor {key!r}", values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _normalize_index(index: Index, n: int) -> slice | np.ndarray:
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


def _check_keys(kind: str, keys: Sequence[str] | None, available: Any) -> list[str]:
    """``keys`` (all of ``available`` when None) after checking that each exists."""
    if keys is None:
        return list(available)
    missing = [k for k in keys if k not in available]
    if missing:
        raise KeyError(f"unknown {kind} keys {missing}; available: {list(available)}")
    return list(keys)


def _values_equal(a: Any, b: Any) -> bool:
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
            return all(map(_values_equal, a.ravel(), b.ravel()))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_values_equal, a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)
