"""A trained model's optimizer, lr schedule and RNG state as files, gathered over FSDP ranks.

Checkpoints hold the *full* (unsharded) state, so they load at any number of workers:
each rank reads the whole file and keeps its own shard. Tensors go to safetensors, the
rest (param-group settings, scheduler counters, Python and numpy RNG) to JSON: nothing
is pickled, so loading a checkpoint runs no code from it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from mmrl.errors import CheckpointError

OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_GROUPS_FILE = "optimizer_param_groups.json"
SCHEDULER_FILE = "lr_scheduler.json"
MODEL_FILE = "model.safetensors"


def save_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    folder: Path,
) -> None:
    """Write the gathered optimizer state (and the lr schedule) to ``folder``; a collective,
    every rank calls it and rank 0 writes.

    ``optimizer.safetensors`` holds ``<param name>/<state key>`` tensors (Adam's ``step``,
    ``exp_avg``, ``exp_avg_sq``), by parameter name rather than position.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(model, optimizer, options=options)
    if dist.get_rank() != 0:
        return
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"{name}/{key}": value.detach().contiguous()
        for name, entries in state["state"].items()
        for key, value in entries.items()
    }
    save_file(tensors, str(folder / OPTIMIZER_FILE))
    (folder / OPTIMIZER_GROUPS_FILE).write_text(json.dumps(state["param_groups"], indent=1))
    if scheduler is not None:
        (folder / SCHEDULER_FILE).write_text(json.dumps(scheduler_state(scheduler), indent=1))


def load_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    folder: Path,
) -> None:
    """Load what :func:`save_optimizer` wrote; every rank reads the full state and keeps its
    shard, whatever the number of ranks that saved it."""
    tensors = _read_safetensors(folder / OPTIMIZER_FILE)
    groups = json.loads(_read_text(folder / OPTIMIZER_GROUPS_FILE))
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, entry = key.rsplit("/", 1)
        state.setdefault(name, {})[entry] = value
    for group in groups:  # JSON turned tuples (Adam's betas) into lists
        for key, value in group.items():
            if key != "params" and isinstance(value, list):
                group[key] = tuple(value)
    set_optimizer_state_dict(
        model,
        optimizer,
        {"state": state, "param_groups": groups},
        options=StateDictOptions(full_state_dict=True),
    )
    if scheduler is not None:
        scheduler.load_state_dict(json.loads(_read_text(folder / SCHEDULER_FILE)))


def scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """The schedule's counters. Its lr functions are code, rebuilt from the config: a
    ``LambdaLR`` records a plain function as None."""
    return scheduler.state_dict()


def save_model_weights(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Gathered weights (rank 0's ``{name: tensor}``) as one safetensors file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Tied weights share storage, which safetensors refuses: each name gets its own copy.
    save_file({k: v.detach().clone().contiguous() for k, v in state_dict.items()}, str(path))


def load_model_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Put full weights ``{name: tensor}`` into a (sharded) model on every rank."""
    result = set_model_state_dict(
        model, weights, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    missing = list(result.missing_keys)
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"the checkpoint's weights do not fit the model: missing {missing[:5]}, "
            f"unexpected {list(result.unexpected_keys)[:5]}",
            fix="resume with the model the checkpoint was trained from",
        )


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, on the CPU."""
    return _read_safetensors(path)


def rng_state() -> dict[str, Any]:
    """This process's Python, numpy and torch (CPU, and CUDA when present) RNG states."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": _jsonable(random.getstate()),
        "numpy": _jsonable(np_state),
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.integer):
        return int(value)
    return value


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    _must_exist(path)
    return load_file(str(path), device="cpu")


def _read_text(path: Path) -> str:
    _must_exist(path)
    return path.read_text()


def _must_exist(path: Path) -> None:
    if not path.is_file():
        raise CheckpointError(
            f"{path.name} is missing",
            where=str(path.parent),
            fix="resume from a complete checkpoint",
        )
