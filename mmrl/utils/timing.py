"""Wall-clock timers and peak memory, reported under verl's metric names."""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def timer(name: str, metrics: dict[str, float]) -> Iterator[None]:
    """Add the block's wall time in seconds to ``metrics["timing_s/<name>"]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing_s/{name}"
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start


def peak_rss_gib() -> float:
    """Peak resident memory of this process and its finished children, in GiB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 2**20  # ru_maxrss is KiB on Linux
