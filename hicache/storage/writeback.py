"""Background L2 -> L3 writeback: a bounded queue drained in batches by one worker thread.

``submit(keys, host_pages, on_done)`` queues pages whose L2 copies the caller keeps pinned until
``on_done(written)`` is called (from the worker thread). When the queue is full the configured choice
applies: ``block`` waits for room, ``drop`` refuses (``submit`` returns False, the caller counts it).
``flush()`` waits for everything queued and returns a :class:`FlushReport` of what could not be written.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from hicache.pool import HostPool
from hicache.storage.base import StorageBackend

DoneFn = Callable[[int], None]


class FlushReport(NamedTuple):
    written_pages: int  # pages stored since the writer started
    failed_pages: int  # pages the store refused or errored on
    dropped_pages: int  # pages refused because the queue was full (policy "drop")
    pending_pages: int  # pages still queued when flush gave up (timeout)


class Writeback:
    def __init__(self, backend: StorageBackend, host_pool: HostPool, max_pages: int, batch_pages: int,
                 when_full: str = "block") -> None:
        self._backend = backend
        self._host_pool = host_pool
        self._max_pages = max_pages
        self._batch = batch_pages
        self._when_full = when_full
        self._q: collections.deque[tuple[list[bytes], np.ndarray, DoneFn]] = collections.deque()
        self._queued_pages = 0
        self._busy = False
        self._cv = threading.Condition()
        self._closed = False
        self.written = self.failed = self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="hicache-writeback", daemon=True)
        self._thread.start()

    @property
    def queued_pages(self) -> int:
        return self._queued_pages

    def submit(self, keys: Sequence[bytes], host_pages: np.ndarray, on_done: DoneFn) -> bool:
        n = len(keys)
        with self._cv:
            if self._closed:
                return False
            while self._queued_pages + n > self._max_pages and self._queued_pages > 0:
                if self._when_full == "drop":
                    self.dropped += n
                    return False
                self._cv.wait()
            self._q.append((list(keys), np.asarray(host_pages), on_done))
            self._queued_pages += n
            self._cv.notify_all()
            return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q and self._closed:
                    return
                keys, pages, on_done = self._q.popleft()
                self._busy = True
            written = 0
            for lo in range(0, len(keys), self._batch):
                hi = min(lo + self._batch, len(keys))
                try:
                    n = self._backend.batch_set(keys[lo:hi], self._host_pool, pages[lo:hi].tolist())
                except Exception:
                    n = 0
                written += n
                if n < hi - lo:
                    break
            try:
                on_done(written)
            finally:
                with self._cv:
                    self.written += written
                    self.failed += len(keys) - written
                    self._queued_pages -= len(keys)
                    self._busy = False
                    self._cv.notify_all()

    def flush(self, timeout_s: float | None = None) -> FlushReport:
        """Wait until the queue is empty (or ``timeout_s`` passes); report what was not written."""
        with self._cv:
            self._cv.wait_for(lambda: not self._q and not self._busy, timeout=timeout_s)
            return FlushReport(self.written, self.failed, self.dropped, self._queued_pages)

    def close(self, timeout_s: float | None = 30.0) -> FlushReport:
        report = self.flush(timeout_s)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)
        return report
