"""Saving and loading a Batch's fields as safetensors plus JSON, without pickle."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
JSON_FILE = "batch.json"
# batch.json encodes tensors, NaN/inf and bytes as dicts keyed by these; user dicts may not use
# them.
_MARKERS = ("__tensor__", "__float__", "__bytes__")
_SUPPORTED = (
    "str, int, float, bool, None, bytes, list, tuple, dict with str keys, "
    "numeric/bool np.ndarray, torch.Tensor"
)


def write_batch(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor],
    non_tensor: Mapping[str, np.ndarray],
    meta: dict[str, Any],
    batch_size: int,
) -> None:
    """Write ``tensors.safetensors`` and ``batch.json`` under ``path``.

    Everything is encoded before the disk is touched, so an unsupported value leaves no files.
    """
    store: dict[str, torch.Tensor] = {
        f"tensors/{k}": t.detach().to("cpu", copy=True).contiguous() for k, t in tensors.items()
    }
    encoded = {
        key: [
            _encode(v, store, f"non_tensor field {key!r}, sample {i}") for i, v in enumerate(values)
        ]
        for key, values in non_tensor.items()
    }
    doc = {
        "format_version": FORMAT_VERSION,
        "batch_size": batch_size,
        "tensor_keys": list(tensors),
        "non_tensor": encoded,
        "meta": _encode(meta, store, "meta"),
    }
    text = json.dumps(doc, allow_nan=False)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(store, str(path / TENSORS_FILE))
    (path / JSON_FILE).write_text(text)


def read_batch(
    path: str | Path, device: torch.device | str = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]], dict[str, Any], int]:
    """``(tensors, non_tensor, meta, batch_size)`` as :func:`write_batch` wrote them."""
    path = Path(path)
    if not (path / JSON_FILE).is_file() or not (path / TENSORS_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is not a saved Batch: expected files {JSON_FILE} and {TENSORS_FILE}"
        )
    doc = json.loads((path / JSON_FILE).read_text())
    if doc.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path / JSON_FILE}: format_version {doc.get('format_version')!r} is not supported, "
            f"expected {FORMAT_VERSION}"
        )
    store = load_file(str(path / TENSORS_FILE))
    tensors = {k: store[f"tensors/{k}"].to(device) for k in doc["tensor_keys"]}
    non_tensor = {k: [_decode(v, store) for v in values] for k, values in doc["non_tensor"].items()}
    return tensors, non_tensor, _decode(doc["meta"], store), doc["batch_size"]


def _encode(value: Any, store: dict[str, torch.Tensor], where: str, path: str = "") -> Any:
    """``value`` as JSON data; arrays and tensors go into ``store`` and are referenced by name."""
    if value is None or isinstance(value, bool | str):
        return str(value) if isinstance(value, str) else value
    if isinstance(value, np.bool_ | np.integer):
        return value.item()
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else {"__float__": repr(float(value))}
    if isinstance(value, int):
        return int(value)
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode("ascii")}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        name = f"nested/{len(store)}"
        store[name] = torch.from_numpy(np.ascontiguousarray(value)).clone()
        return {"__tensor__": name, "kind": "numpy"}
    if isinstance(value, torch.Tensor):
        name = f"nested/{len(store)}"
        store[name] = value.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": name, "kind": "torch"}
    if isinstance(value, list | tuple):
        return [_encode(v, store, where, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str) or k in _MARKERS:
                raise TypeError(
                    f"cannot save {where} at {path or '.'}: dict key {k!r} must be a str other "
                    f"than the reserved {_MARKERS}"
                )
        return {k: _encode(v, store, where, f"{path}[{k!r}]") for k, v in value.items()}
    found = (
        f"np.ndarray of dtype {value.dtype}"
        if isinstance(value, np.ndarray)
        else type(value).__qualname__
    )
    raise TypeError(
        f"cannot save {where} at {path or '.'}: type {found} is not supported; expected "
        f"{_SUPPORTED}"
    )


def _decode(value: Any, store: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, store) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        tensor = store[value["__tensor__"]]
        return tensor.numpy() if value["kind"] == "numpy" else tensor
    if "__float__" in value:
        return float(value["__float__"])
    if "__bytes__" in value:
        return base64.b64decode(value["__bytes__"])
    return {k: _decode(v, store) for k, v in value.items()}
