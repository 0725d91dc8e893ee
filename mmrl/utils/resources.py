"""What a run holds: memory, open files and threads of this process and all its descendants.

Logged every step (``system/*``) so that a leak shows as a rising line: Ray's processes
(started by this driver) and verifier worker processes are descendants and count too.
"""

from __future__ import annotations

import psutil


def process_tree_stats() -> dict[str, float]:
    """``system/rss_mib`` (summed resident memory, MiB), ``system/num_fds``,
    ``system/num_threads`` and ``system/num_processes`` of this process and its descendants.

    Summed RSS counts shared pages once per process; its growth, not its level, is the
    signal.
    """
    root = psutil.Process()
    rss = fds = threads = count = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                fds += proc.num_fds()
                threads += proc.num_threads()
            count += 1
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue  # a process that ended while being read
    return {
        "system/rss_mib": rss / 2**20,
        "system/num_fds": float(fds),
        "system/num_threads": float(threads),
        "system/num_processes": float(count),
    }


def descendants() -> list[psutil.Process]:
    """Live descendant processes of this one (zombies excluded)."""
    alive = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive
