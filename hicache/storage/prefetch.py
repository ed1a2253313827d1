"""L3 -> L2 prefetch: background reads into host pages, ended by policy.

A :class:`PrefetchTask` owns its host pages from creation until :meth:`PrefetchTask.finish` or
:meth:`PrefetchTask.cancel`. ``finish`` applies the policy's wait -- ``best_effort`` takes what has
landed now (``wait_s=0``), ``wait_complete`` waits for all (``None``), ``timeout`` waits up to the
configured bound -- then stops the worker and returns how many leading pages are complete; those pages
now belong to the caller. Every other page is handed back through ``release_pages`` exactly once, and
only once the worker can no longer write into it, on every path: success, short read, timeout,
cancellation, a store error, a task that never got a worker thread.

Lifecycle: ``pending`` (queued on the :class:`Prefetcher`) -> ``running`` -> ``done``. Stopping a
pending task means it never touches the store. ``finish`` and ``cancel`` are idempotent and may race
each other from different threads; ``cancel`` after ``finish`` is a no-op (the pages are the caller's).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hicache.pool import HostPool
from hicache.storage.base import StorageBackend

log = logging.getLogger(__name__)


class PrefetchTask:
    def __init__(
        self,
        backend: StorageBackend,
        keys: Sequence[bytes],
        host_pool: HostPool,
        host_pages: np.ndarray,
        batch_pages: int,
        release_pages: Callable[[np.ndarray], None],
        observe: Callable[[float], None] | None = None,
    ) -> None:
        if len(keys) != len(host_pages):
            raise ValueError(f"prefetch: {len(keys)} keys but {len(host_pages)} host pages")
        if batch_pages < 1:
            raise ValueError(f"prefetch: batch_pages must be >= 1, got {batch_pages}")
        self.keys = list(keys)
        self.host_pages = np.asarray(host_pages, dtype=np.int64)
        self.completed = 0  # leading pages verified and written into host_pages (worker-owned until done)
        # the worker stopped because the store did not return page ``completed`` (absent, damaged, foreign,
        # the store failing), not because it was stopped (worker-owned until done)
        self.missed = False
        self.error: BaseException | None = None  # what a backend raised, if it broke its contract
        self.created_at = time.monotonic()
        self.finished_at: float | None = None
        self._backend = backend
        self._host_pool = host_pool
        self._batch = batch_pages
        self._release = release_pages
        self._observe = observe  # seconds of each batch_get
        self._lock = threading.Lock()  # guards _started / _stop against run() starting
        self._end_lock = threading.Lock()  # serialises finish / cancel
        self._stop = threading.Event()
        self._finished = threading.Event()  # the worker has exited (or will never run)
        self._started = False
        self._handed = -1  # pages handed to the caller by finish(); -1 while not finished
        self._cancelled = False

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def handed(self) -> int:
        """Leading pages :meth:`finish` handed to the caller (0 after :meth:`cancel`; -1 before either)."""
        return self._handed

    def run(self) -> None:
        """Worker body: read batch by batch until done, a miss/corrupt page, an error, or stop."""
        with self._lock:
            if self._stop.is_set():
                self._finished.set()
                return
            self._started = True
        try:
            while self.completed < len(self.keys) and not self._stop.is_set():
                lo = self.completed
                hi = min(lo + self._batch, len(self.keys))
                t0 = time.perf_counter()
                try:
                    n = self._backend.batch_get(self.keys[lo:hi], self._host_pool, self.host_pages[lo:hi].tolist())
                except Exception as e:  # a backend must not raise; never let one kill the worker
                    log.warning("prefetch: backend raised %r; stopping this prefetch", e)
                    self.error = e
                    n = 0
                if self._observe is not None:
                    self._observe(time.perf_counter() - t0)
                self.completed = lo + max(0, min(n, hi - lo))
                if n < hi - lo:
                    self.missed = True
                    break
        finally:
            self.finished_at = time.monotonic()
            self._finished.set()

    def _abandon(self) -> None:
        """The task will never run (its queue was shut down): mark it finished."""
        with self._lock:
            self._stop.set()
            if not self._started:
                self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def _end(self, wait_s: float | None) -> int:
        if wait_s is None or wait_s >= threading.TIMEOUT_MAX:  # longer than a thread can wait: no bound
            self._finished.wait()
        elif wait_s > 0:
            self._finished.wait(wait_s)
        with self._lock:
            self._stop.set()
            started = self._started
        if started:
            self._finished.wait()  # at most the batch in flight
        n = self.completed if started else 0
        if n < len(self.host_pages):
            self._release(self.host_pages[n:])
        self._handed = n
        return n

    def finish(self, wait_s: float | None) -> int:
        """Stop after waiting up to ``wait_s`` seconds (None: until complete); return pages usable.

        The first ``n`` host pages now belong to the caller; the rest were released.
        """
        with self._end_lock:
            if self._handed >= 0:
                return self._handed
            return self._end(wait_s)

    def cancel(self) -> None:
        """The request went away before :meth:`finish`: stop and release every page.

        After ``finish`` this does nothing (those pages are the caller's now).
        """
        with self._end_lock:
            if self._handed >= 0:
                return
            n = self._end(0.0)
            if n:
                self._release(self.host_pages[:n])
            self._handed = 0
            self._cancelled = True


class Prefetcher:
    """Runs prefetch tasks on a small thread pool (``workers`` reads in flight at most)."""

    def __init__(self, workers: int = 4) -> None:
        if workers < 1:
            raise ValueError(f"prefetch workers: must be >= 1, got {workers}")
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hicache-prefetch")
        self._live: set[PrefetchTask] = set()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def live_tasks(self) -> int:
        """Tasks submitted and not yet finished (queued or running)."""
        with self._lock:
            return len(self._live)

    def submit(self, task: PrefetchTask) -> PrefetchTask:
        """Queue ``task``. After :meth:`close` the task is abandoned at once (``finish`` returns 0)."""
        with self._lock:
            if self._closed:
                task._abandon()
                return task
            self._live.add(task)
        fut = self._pool.submit(task.run)
        fut.add_done_callback(lambda f, t=task: self._done(f, t))  # type: ignore[misc]
        return task

    def _done(self, fut: Future[None], task: PrefetchTask) -> None:
        if fut.cancelled():
            task._abandon()
        with self._lock:
            self._live.discard(task)

    def close(self) -> None:
        """Stop every task (each ends after its current batch), drop queued ones, join the workers."""
        with self._lock:
            self._closed = True
            live = list(self._live)
        for t in live:
            t._abandon()
        self._pool.shutdown(wait=True, cancel_futures=True)
