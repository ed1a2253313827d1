"""L3 -> L2 prefetch: background reads into host pages, ended by policy.

A :class:`PrefetchTask` owns its host pages from start until :meth:`PrefetchTask.finish`. ``finish``
applies the policy -- ``best_effort`` takes what has landed now, ``wait_complete`` waits for all,
``timeout`` waits up to the configured bound -- then stops the worker and returns how many leading
pages are complete. Pages past that count are handed back through ``release_pages`` (once the worker
can no longer write into them), on every path: success, timeout, cancellation, store errors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hicache.pool import HostPool
from hicache.storage.base import StorageBackend


class PrefetchTask:
    def __init__(
        self,
        backend: StorageBackend,
        keys: Sequence[bytes],
        host_pool: HostPool,
        host_pages: np.ndarray,
        batch_pages: int,
        release_pages: Callable[[np.ndarray], None],
    ) -> None:
        self.keys = list(keys)
        self.host_pages = host_pages
        self.completed = 0  # leading pages verified and written into host_pages
        self._backend = backend
        self._host_pool = host_pool
        self._batch = batch_pages
        self._release = release_pages
        self._stop = threading.Event()
        self._finished = threading.Event()  # worker has exited
        self._handed = -1  # pages handed to the caller by finish(); -1 while running

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    def run(self) -> None:
        """Worker body: read batch by batch until done, a miss/corrupt page, an error, or stop."""
        try:
            while self.completed < len(self.keys) and not self._stop.is_set():
                lo = self.completed
                hi = min(lo + self._batch, len(self.keys))
                try:
                    n = self._backend.batch_get(self.keys[lo:hi], self._host_pool, self.host_pages[lo:hi].tolist())
                except Exception:  # a backend must not raise, but never let one kill the worker
                    n = 0
                self.completed = lo + n
                if n < hi - lo:
                    break
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def finish(self, wait_s: float | None) -> int:
        """Stop after waiting up to ``wait_s`` seconds (None: until complete); return pages usable.

        The first ``n`` host pages now belong to the caller; the rest were released.
        """
        if self._handed >= 0:
            return self._handed
        if wait_s is None:
            self._finished.wait()
        elif wait_s > 0:
            self._finished.wait(wait_s)
        self._stop.set()
        self._finished.wait()  # at most one in-flight batch
        n = self.completed
        if n < len(self.host_pages):
            self._release(self.host_pages[n:])
        self._handed = n
        return n

    def cancel(self) -> None:
        """The request went away: release every page."""
        n = self.finish(0.0)
        if n:
            self._release(self.host_pages[:n])
        self._handed = 0


class Prefetcher:
    """Runs prefetch tasks on a small thread pool."""

    def __init__(self, workers: int = 4) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hicache-prefetch")

    def submit(self, task: PrefetchTask) -> PrefetchTask:
        self._pool.submit(task.run)
        return task

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
