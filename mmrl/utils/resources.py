"""What a run holds: memory, open files and threads of this process and all its descendants.

Logged every step (``system/*``) so that a leak shows as a rising line: Ray's processes
(started by this driver) and verifier worker processes are descendants and count too.
"""

from __future__ import annotations

import psutil


def process_tree_stats() -> dict[str, float]:
    """``system/rss_mib`` (summed resident memory, MiB), ``system/private_mib`` (the same
    without shared pages), ``system/num_fds``, ``system/num_threads`` and
    ``system/num_processes`` of this process and its descendants.

    Summed RSS counts shared pages once per process, and it includes the pages of Ray's
    shared-memory object store that a worker has read: those grow as more of the store is
    touched, up to its size, without anything leaking. ``private_mib`` leaves shared pages
    out, so its growth is what a process holds on to.
    """
    root = psutil.Process()
    rss = private = fds = threads = count = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            with proc.oneshot():
                mem = proc.memory_info()
                rss += mem.rss
                private += mem.rss - mem.shared
                fds += proc.num_fds()
                threads += proc.num_threads()
            count += 1
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue  # a process that ended while being read
    return {
        "system/rss_mib": rss / 2**20,
        "system/private_mib": private / 2**20,
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
