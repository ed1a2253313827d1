"""Background L2 -> L3 writeback: a bounded queue drained in batches by one worker thread.

``submit(keys, host_pages, on_done)`` queues pages whose L2 copies the caller keeps pinned until
``on_done(written)`` is called (from the completion thread, or at once in ``submit`` for an empty
submission; exactly once per accepted submission, with
how many of its pages the store accepted; never while the queue waits on it). Queued submissions are
coalesced into ``batch_pages``-page ``batch_set`` calls. When the queue (``max_pages``) is full the
configured choice applies: ``block`` waits for room (up to ``block_timeout_s``, then drops), ``drop``
refuses at once. A refused submission
returns False, its pages are counted in ``dropped`` and ``on_done`` is not called: the caller keeps
ownership. A single submission larger than the whole queue is accepted when the queue is empty.

``flush(timeout_s)`` waits for everything queued and returns a :class:`FlushReport` of what could not be
written. ``close(timeout_s)`` flushes, then abandons whatever is still queued (``on_done(0)`` for each,
counted as pending) and stops the worker. A failing store or an ``on_done`` that raises never stops the
worker.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from hicache.pool import HostPool
from hicache.storage.base import StorageBackend

log = logging.getLogger(__name__)

DoneFn = Callable[[int], None]


class FlushReport(NamedTuple):
    written_pages: int  # pages stored since the writer started
    failed_pages: int  # pages the store refused or errored on
    dropped_pages: int  # pages refused because the queue was full (or the writer closed)
    pending_pages: int  # pages still queued when flush gave up (timeout) / abandoned by close

    @property
    def complete(self) -> bool:
        """Everything ever submitted reached the store."""
        return self.failed_pages == 0 and self.dropped_pages == 0 and self.pending_pages == 0


class _Job(NamedTuple):
    keys: list[bytes]
    pages: np.ndarray
    on_done: DoneFn


class Writeback:
    def __init__(self, backend: StorageBackend, host_pool: HostPool, max_pages: int, batch_pages: int,
                 when_full: str = "block", block_timeout_s: float | None = None,
                 observe: Callable[[float], None] | None = None) -> None:
        if max_pages < 1 or batch_pages < 1:
            raise ValueError("writeback: max_pages and batch_pages must be >= 1")
        if when_full not in ("block", "drop"):
            raise ValueError(f"writeback when_full: must be 'block' or 'drop', got {when_full!r}")
        self._backend = backend
        self._host_pool = host_pool
        self._max_pages = max_pages
        self._batch = batch_pages
        self._when_full = when_full
        self._block_timeout = block_timeout_s
        self._observe = observe  # seconds of each batch_set
        self._q: collections.deque[_Job] = collections.deque()
        self._queued_pages = 0  # queued + being written
        self._busy = False
        self._cv = threading.Condition()
        self._closed = False
        self._abandon = False
        self.written = self.failed = self.dropped = self.abandoned = 0
        self.batches = 0  # batch_set calls made
        self._done: collections.deque[tuple[_Job, int]] = collections.deque()  # completions to deliver
        self._undelivered = 0  # accepted jobs whose on_done has not returned yet
        self._writer_done = False
        self._thread = threading.Thread(target=self._run, name="hicache-writeback", daemon=True)
        self._notifier = threading.Thread(target=self._deliver, name="hicache-writeback-done", daemon=True)
        self._thread.start()
        self._notifier.start()

    @property
    def queued_pages(self) -> int:
        return self._queued_pages

    def submit(self, keys: Sequence[bytes], host_pages: np.ndarray, on_done: DoneFn) -> bool:
        """Queue pages for the store; False when refused (queue full under ``drop``, timeout, closed)."""
        pages = np.asarray(host_pages, dtype=np.int64)
        n = len(keys)
        if n != len(pages):
            raise ValueError(f"writeback: {n} keys but {len(pages)} host pages")
        if n == 0:
            on_done(0)
            return True
        with self._cv:
            def room() -> bool:
                return self._closed or self._queued_pages == 0 or self._queued_pages + n <= self._max_pages

            if not room() and (self._when_full == "drop" or not self._cv.wait_for(room, timeout=self._block_timeout)):
                self.dropped += n
                return False
            if self._closed:
                self.dropped += n
                return False
            self._q.append(_Job(list(keys), pages, on_done))
            self._queued_pages += n
            self._undelivered += 1
            self._cv.notify_all()
            return True

    def _take(self) -> list[_Job] | None:
        """Jobs for the next batch (at least one; more while they fit); None when it is time to exit."""
        with self._cv:
            while not self._q and not self._closed:
                self._cv.wait()
            if not self._q or self._abandon:
                return None
            jobs = [self._q.popleft()]
            total = len(jobs[0].keys)
            while self._q and total + len(self._q[0].keys) <= self._batch:
                total += len(self._q[0].keys)
                jobs.append(self._q.popleft())
            self._busy = True
            return jobs

    def _write(self, jobs: list[_Job]) -> list[tuple[int, int]]:
        """Store the jobs' pages in batches; (pages stored, pages tried) per job. Once ``close`` abandons the
        queue, the batches not yet begun are left untried (the pages count as abandoned), so a job of many
        pages cannot hold the worker for long past the close's deadline."""
        keys = [k for j in jobs for k in j.keys]
        pages = np.concatenate([j.pages for j in jobs])
        ok = np.zeros(len(keys), dtype=bool)
        tried = np.zeros(len(keys), dtype=bool)
        for lo in range(0, len(keys), self._batch):
            if self._abandon:
                break
            hi = min(lo + self._batch, len(keys))
            t0 = time.perf_counter()
            try:
                n = self._backend.batch_set(keys[lo:hi], self._host_pool, pages[lo:hi].tolist())
            except Exception as e:  # a backend must not raise; the worker must survive one that does
                log.warning("writeback: backend raised %r", e)
                n = 0
            if self._observe is not None:
                self._observe(time.perf_counter() - t0)
            self.batches += 1
            tried[lo:hi] = True
            ok[lo : lo + max(0, min(n, hi - lo))] = True
        out, off = [], 0
        for j in jobs:
            end = off + len(j.keys)
            out.append((int(ok[off:end].sum()), int(tried[off:end].sum())))
            off = end
        return out

    def _run(self) -> None:
        while True:
            jobs = self._take()
            if jobs is None:
                break
            written = self._write(jobs)
            with self._cv:
                for j, (w, tried) in zip(jobs, written, strict=True):
                    self.written += w
                    self.failed += tried - w
                    self.abandoned += len(j.keys) - tried
                    self._queued_pages -= len(j.keys)  # room for blocked submitters, before any callback
                    self._done.append((j, w))
                self._busy = False
                self._cv.notify_all()
        with self._cv:  # abandoned at close: hand every queued job back
            for j in self._q:
                self.abandoned += len(j.keys)
                self._queued_pages -= len(j.keys)
                self._done.append((j, 0))
            self._q.clear()
            self._writer_done = True
            self._cv.notify_all()

    def _deliver(self) -> None:
        """Completion thread: ``on_done`` runs here, never on the writer, so a callback that waits for a
        lock held by a blocked submitter cannot stall the queue."""
        while True:
            with self._cv:
                while not self._done and not self._writer_done:
                    self._cv.wait()
                if not self._done:
                    return
                job, w = self._done.popleft()
            try:
                job.on_done(w)
            except Exception:
                log.exception("writeback: on_done callback raised")
            with self._cv:
                self._undelivered -= 1
                self._cv.notify_all()

    def report(self) -> FlushReport:
        with self._cv:
            return FlushReport(self.written, self.failed, self.dropped, self._queued_pages + self.abandoned)

    def flush(self, timeout_s: float | None = None) -> FlushReport:
        """Wait until the queue is empty (or ``timeout_s`` passes); report what was not written."""
        with self._cv:
            self._cv.wait_for(lambda: not self._q and not self._busy and self._undelivered == 0, timeout=timeout_s)
        return self.report()

    def close(self, timeout_s: float | None = 30.0, join_timeout_s: float = 10.0) -> FlushReport:
        """Flush (up to ``timeout_s``; 0 when the caller has flushed already), then abandon what is left
        and stop the worker, waiting up to ``join_timeout_s`` for the batch it is writing (bounded by the
        store's own timeouts: batches of the job in hand not yet begun are abandoned too). The report is
        final: abandoned pages count as pending."""
        self.flush(timeout_s)
        with self._cv:
            self._closed = True
            self._abandon = True
            self._cv.notify_all()
        self._thread.join(timeout=join_timeout_s)
        self._notifier.join(timeout=join_timeout_s)
        return self.report()
