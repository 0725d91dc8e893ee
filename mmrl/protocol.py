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
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from mmrl.utils.batch_fields import (
    Index,
    as_object_array,
    check_keys,
    field_length,
    normalize_index,
    values_equal,
)
from mmrl.utils.batch_io import read_batch, write_batch


class Batch:
    """``B`` samples as ``tensors`` (TensorDict, batch_size [B]), ``non_tensor`` (object arrays [B])
    and ``meta``.

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
        """Build a Batch whose length B is taken from the first field; every field must have B
        rows."""
        tensors, non_tensor = dict(tensors or {}), dict(non_tensor or {})
        bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(
                f"tensors {bad} are not torch.Tensor; pass other per-sample values as non_tensor"
            )
        fields = [(k, v, True) for k, v in tensors.items()]
        fields += [(k, v, False) for k, v in non_tensor.items()]
        n = field_length(f"field {fields[0][0]!r}", fields[0][1]) if fields else 0
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
        return self._take(normalize_index(index, len(self)))

    def __setitem__(self, key: str, value: torch.Tensor | np.ndarray | Sequence[Any]) -> None:
        """Set a tensor field (Tensor) or a non-tensor field (array or list); either must have B
        rows.
        """
        self._set(key, value, is_tensor=isinstance(value, torch.Tensor))

    def _set(self, key: str, value: Any, is_tensor: bool) -> None:
        kind, other = ("tensor", "non_tensor") if is_tensor else ("non_tensor", "tensor")
        if key in (self.non_tensor if is_tensor else self.tensors):
            raise ValueError(
                f"cannot set {kind} {key!r}: it already names a {other} field; pop it first"
            )
        n = field_length(f"{kind} {key!r}", value)
        if n != len(self):
            raise ValueError(
                f"{kind} {key!r} has length {n}, expected {len(self)} (the batch size)"
            )
        if is_tensor:
            self.tensors[key] = value
        else:
            self.non_tensor[key] = as_object_array(key, value)

    def row(self, i: int) -> dict[str, Any]:
        """Sample ``i`` as ``{key: value}`` over tensor and non-tensor fields (meta excluded)."""
        i = normalize_index(int(i), len(self)).start
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
        """Stack the rows of ``batches`` in order. All must have the same keys; meta comes from
        ``batches[0]``.
        """
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
                        f"concat: batch {i} and batch 0 differ in {kind} keys "
                        f"{sorted(set(ref) ^ set(got))}"
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
        """Permute rows in place so that new row ``i`` is old row ``indices[i]``; returns
        ``self``."""
        index = normalize_index(indices, len(self))
        if isinstance(index, slice) or not np.array_equal(np.sort(index), np.arange(len(self))):
            raise ValueError(
                f"reorder needs a permutation of range({len(self)}); the indices repeat or skip "
                "rows"
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
                if not values_equal(mine[key], theirs[key]):
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
        """A new Batch with only these keys (None keeps every key of that kind). Values are shared,
        not copied.
        """
        return Batch(
            self.tensors.select(*check_keys("tensor", tensor_keys, self.keys())),
            {
                k: self.non_tensor[k]
                for k in check_keys("non_tensor", non_tensor_keys, self.non_tensor)
            },
            {k: self.meta[k] for k in check_keys("meta", meta_keys, self.meta)},
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
