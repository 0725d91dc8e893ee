"""FSDP2 on the default process group: joining it, sharding a model, gathering full weights.

One process is one data-parallel rank. The same functions run with one rank
(the embedded mode) and with many (Ray workers), so there is one training path.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

MIXED_PRECISION = {"bf16": torch.bfloat16, "fp32": None}
# The device type of this process's group ("cpu" or "cuda"), set when it is joined.
_group_device_type = "cpu"


def init_process_group(
    rank: int,
    world_size: int,
    device_type: str,
    timeout_s: float,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> None:
    """Join the default process group: gloo on CPU, nccl (plus gloo for CPU tensors) on GPU.

    A one-rank group without ``master_addr`` uses an in-memory store, so the embedded
    mode opens no port. A process that already has a group of the same size keeps it
    (an embedded run after another one in the same process). ``timeout_s`` bounds
    every collective: a dead peer becomes an error instead of a 30-minute hang.
    """
    global _group_device_type
    if dist.is_initialized():
        if (dist.get_world_size(), _group_device_type) != (world_size, device_type):
            raise RuntimeError(
                f"this process already belongs to a {_group_device_type} process group of "
                f"{dist.get_world_size()} ranks; cannot join a {device_type} one of {world_size}"
            )
        return
    _group_device_type = device_type
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if device_type == "cuda":
        # Ray shows each GPU worker only its own GPU.
        torch.cuda.set_device(0)
    if master_addr is None:
        if world_size != 1:
            raise ValueError(f"a process group of {world_size} ranks needs a master address")
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def device() -> torch.device:
    """This rank's compute device: its GPU in a GPU group, else the CPU."""
    if _group_device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def data_parallel_mesh() -> DeviceMesh:
    """A 1-D mesh over every rank of the default group (pure data-parallel sharding)."""
    return init_device_mesh(device().type, (dist.get_world_size(),))


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX tiles). Without
    them a bf16 matmul is emulated and about 15x slower than fp32 (docs/scaling.md)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def resolve_precision(name: str, device_type: str, bf16_ok: bool = True) -> str:
    """``trainer.mixed_precision`` as the run uses it: ``auto`` is bf16 on a GPU and on a CPU
    with bf16 instructions (:func:`cpu_has_bf16`) for a model that tolerates it (``bf16_ok``,
    the policy family's ``auto_bf16``), else fp32."""
    if name == "auto":
        hardware = device_type == "cuda" or cpu_has_bf16()
        name = "bf16" if bf16_ok and hardware else "fp32"
    if name not in MIXED_PRECISION:
        raise ValueError(
            f"trainer.mixed_precision={name!r}; expected one of {['auto', *MIXED_PRECISION]}"
        )
    return name


def mixed_precision_policy(
    name: str, device_type: str, bf16_ok: bool = True
) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for ``trainer.mixed_precision`` (:func:`resolve_precision`).

    Parameters and optimizer state stay fp32; gradients are reduced in fp32.
    """
    dtype = MIXED_PRECISION[resolve_precision(name, device_type, bf16_ok)]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None


def shard_model(model: nn.Module, mp_policy: MixedPrecisionPolicy | None) -> nn.Module:
    """``fully_shard`` each transformer block, then the root (embeddings, head, norms).

    Blocks are the classes a transformers model lists in ``_no_split_modules``. Blocks
    free their gathered weights after forward; the root keeps its own until backward,
    which it needs next anyway.
    """
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no transformer block class in _no_split_modules, "
            "so it cannot be sharded block by block"
        )
    kwargs = {"mesh": data_parallel_mesh()}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in blocks:
        fully_shard(block, reshard_after_forward=True, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


@contextmanager
def full_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Keep every FSDP unit's full weights gathered inside the block.

    Forwards inside then run no collectives. Generation needs this: ranks stop
    decoding after different numbers of steps, and per-step all-gathers would no
    longer pair up across ranks.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not model, recurse=False)


def full_state_dict(model: nn.Module, on_every_rank: bool) -> dict[str, torch.Tensor]:
    """The unsharded weights by parameter name; a collective, so every rank must call it.

    ``on_every_rank=False`` gathers onto rank 0's CPU only (other ranks get ``{}``), for
    saving. ``on_every_rank=True`` gives each rank the full weights on its device, for
    the rollout engine that each rank owns.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=not on_every_rank)
    return get_model_state_dict(model, options=options)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded gradients of the last backward, by parameter name, on rank 0's CPU
    (``{}`` on the other ranks); a collective, so every rank must call it.

    One rank's gradient equals two ranks' only if every loss term is averaged over the
    whole batch, which is what equivalence tests compare (weights after an Adam step
    agree whenever the gradients' signs do).
    """
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name] = grad.detach().float().cpu().clone()
    return out if dist.get_rank() == 0 else {}


def memory_stats() -> dict[str, float]:
    """Peak resident memory of this process (GiB) and, on GPU, peak allocated GPU memory."""
    stats = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if device().type == "cuda":
        stats["cuda_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return stats
