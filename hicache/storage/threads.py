"""Thread pools for store I/O, and background work that yields the CPU.

L2 -> L3 writeback is background work; a request's reads are not. A write path that keeps as many
threads busy as there are cores (checksums, the kernel's copies) starves the thread that drives the GPU,
so the backends run write-side work on pools made by :func:`io_pool` with ``nice`` > 0: Linux schedules
threads one by one, and each of these lowers its own priority when it starts.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

MAX_NICE = 19


def check_nice(name: str, nice: int) -> None:
    """``ValueError`` naming the option unless ``0 <= nice <= 19``."""
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"{name}: must be in [0, {MAX_NICE}], got {nice}")


def lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority by ``nice`` (elsewhere than Linux, or without the right,
    the thread keeps its priority)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass


def io_pool(workers: int, name: str, nice: int = 0) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads named ``name``; with ``nice`` > 0 each lowers its own priority."""
    if nice > 0:
        return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=lower_priority,
                                  initargs=(nice,))
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
