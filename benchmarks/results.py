"""What every multi-seed benchmark reports: mean ± sample standard deviation (ddof=1), and
its raw per-seed results in benchmarks/results/<name>.json, which docs/benchmarks.md cites."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.hybrid.fsdp import cpu_has_bf16

RESULTS = Path(__file__).resolve().parent / "results"


def mean_std(values: Any, digits: int = 3) -> str:
    """``mean ± s`` with the sample standard deviation; one value has no spread."""
    arr = np.asarray(values, dtype=float)
    if arr.size < 2:
        return f"{arr.mean():.{digits}f}"
    return f"{arr.mean():.{digits}f} ± {arr.std(ddof=1):.{digits}f}"


def machine() -> str:
    """The architecture, CPU count and whether bf16 matmuls run in hardware: on a CPU without
    AVX512-BF16 or AMX, bf16 is emulated, and every precision comparison reads differently."""
    bf16 = "bf16 in hardware" if cpu_has_bf16() else "no bf16 instructions"
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {bf16}"


def write_results(name: str, per_seed: Any, command: str, **extra: Any) -> Path:
    """Write ``per_seed`` (the raw numbers, one entry per seed) to ``results/<name>.json``."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {
        "command": command,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": machine(),
        "load_average_5min": round(os.getloadavg()[1], 2),
        "per_seed": per_seed,
        **extra,
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"raw results: {path}")
    return path
