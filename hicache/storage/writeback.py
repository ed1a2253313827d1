"""Background L2 -> L3 writeback: a bounded queue drained in batches by one worker thread, and the retry of
writes that failed.

``submit(keys, host_pages, on_done)`` queues pages whose L2 copies the caller keeps pinned until
``on_done(written)`` is called (from the completion thread, or at once in ``submit`` for an empty
submission; exactly once per accepted submission, with
how many of its pages the store accepted; never while the queue waits on it). Queued submissions are
coalesced into ``batch_pages``-page ``batch_set`` calls. When the queue (``max_pages``) is full the
configured choice applies: ``block`` waits for room (up to ``block_timeout_s``, then drops), ``drop``
refuses at once. A refused submission
returns False, its pages are counted in ``dropped`` and ``on_done`` is not called: the caller keeps
ownership. A single submission larger than the whole queue is accepted when the queue is empty.

Pages the store did not take (it failed, refused, or was down) are tried again while they are still on L2
(the caller keeps them pinned until ``on_done``), each after its own backoff (``RETRY_BASE_S`` doubling
up to ``RETRY_MAX_S``), so an L3 outage ends with L3 holding every page written meanwhile. They wait
beside the queue, not in it (a store that is down never blocks a submitter), at most ``retry_pages``
of them (default: ``max_pages``, and at most half of the host pool, so that L2 keeps room): past that
the oldest are given up, counted in ``retry_dropped`` (``on_retry_dropped``) and ``failed``, and their
submissions end. ``retry_pages=0`` gives every failure up at once.

``flush(timeout_s)`` waits for everything queued, tries every page waiting for a retry once more at once,
and returns a :class:`FlushReport` of what could not be written (pages still waiting for a retry count
as failed). ``close(timeout_s)`` flushes, then abandons whatever is still queued or waiting for a retry
(``on_done`` with what was written, counted as pending) and stops the worker. A failing store or an
``on_done`` that raises never stops the worker.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hicache.pool import HostPool
from hicache.storage.base import StorageBackend

log = logging.getLogger(__name__)

DoneFn = Callable[[int], None]

RETRY_BASE_S = 0.05  # backoff before a failed page's first retry
RETRY_MAX_S = 2.0  # cap on one backoff: how late, at most, writes resume after the store is back


class FlushReport(NamedTuple):
    written_pages: int  # pages stored since the writer started
    failed_pages: int  # pages the store refused or errored on and has not taken since (retrying, or given up)
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


@dataclass
class _State:
    """An accepted submission (the ``seq``-th): ``left`` of its pages are neither written nor given up yet."""

    job: _Job
    seq: int
    left: int
    written: int = 0


@dataclass
class _Part:
    """Pages of one submission to write: all of it at first, the pages a write failed on afterwards."""

    state: _State
    keys: list[bytes]
    pages: np.ndarray
    retry: bool = False  # waiting beside the queue (a write failed), not queued
    attempts: int = 0  # failed writes so far
    due: float = 0.0  # monotonic time of its next try
    tried: float = 0.0  # monotonic time its last try began


class Writeback:
    def __init__(self, backend: StorageBackend, host_pool: HostPool, max_pages: int, batch_pages: int,
                 when_full: str = "block", block_timeout_s: float | None = None,
                 observe: Callable[[float], None] | None = None, retry_pages: int | None = None,
                 on_retry_dropped: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_pages < 1 or batch_pages < 1:
            raise ValueError("writeback: max_pages and batch_pages must be >= 1")
        if when_full not in ("block", "drop"):
            raise ValueError(f"writeback when_full: must be 'block' or 'drop', got {when_full!r}")
        if retry_pages is not None and retry_pages < 0:
            raise ValueError(f"writeback retry_pages: must be >= 0, got {retry_pages}")
        self._backend = backend
        self._host_pool = host_pool
        self._max_pages = max_pages
        self._batch = batch_pages
        self._when_full = when_full
        self._block_timeout = block_timeout_s
        self._observe = observe  # seconds of each batch_set
        self._retry_max = min(max_pages, host_pool.num_pages // 2) if retry_pages is None else retry_pages
        self._on_retry_dropped = on_retry_dropped
        self._clock = clock
        self._q: collections.deque[_Part] = collections.deque()
        self._queued_pages = 0  # queued + being written (the room submitters wait for)
        self._retry: list[_Part] = []  # oldest submission first
        self._seq = 0  # submissions accepted
        self._retry_pages = 0  # waiting for a retry + being retried
        self._busy = False
        self._cv = threading.Condition()
        self._closed = False
        self._abandon = False
        self.written = self.failed = self.dropped = self.abandoned = 0
        self.retry_dropped = 0  # failed pages given up because more failed than the retry queue holds
        self.batches = 0  # batch_set calls made
        self._done: collections.deque[_State] = collections.deque()  # completions to deliver
        self._undelivered = 0  # accepted jobs whose on_done has not returned yet
        self._flushing: list[float] = []  # start times of the flushes waiting now
        self._writer_done = False
        self._thread = threading.Thread(target=self._run, name="hicache-writeback", daemon=True)
        self._notifier = threading.Thread(target=self._deliver, name="hicache-writeback-done", daemon=True)
        self._thread.start()
        self._notifier.start()

    @property
    def queued_pages(self) -> int:
        """Pages not written yet: queued, being written, or waiting to be tried again."""
        return self._queued_pages + self._retry_pages

    @property
    def retrying_pages(self) -> int:
        """Pages a write failed on, waiting to be tried again (or being tried)."""
        return self._retry_pages

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
            job = _Job(list(keys), pages, on_done)
            self._seq += 1
            self._q.append(_Part(_State(job, self._seq, n), job.keys, pages))
            self._queued_pages += n
            self._undelivered += 1
            self._cv.notify_all()
            return True

    def _next_due(self) -> float | None:
        """When the earliest retry is due (None: none waits)."""
        return min((p.due for p in self._retry), default=None)

    def _take(self) -> list[_Part] | None:
        """Parts for the next batch (at least one; more while they fit): retries that are due first, oldest
        first, then queued parts; None when it is time to exit."""
        with self._cv:
            while True:
                if self._abandon or (self._closed and not self._q):
                    return None
                now = self._clock()
                due = self._next_due()
                if self._q or (due is not None and due <= now):
                    break
                self._cv.wait(None if due is None else max(0.0, due - now))
            parts: list[_Part] = []
            total = 0
            if due is not None and due <= now:
                keep: list[_Part] = []
                for p in self._retry:
                    if p.due <= now and (not parts or total + len(p.keys) <= self._batch):
                        parts.append(p)
                        total += len(p.keys)
                    else:
                        keep.append(p)
                self._retry = keep
            while self._q and (not parts or total + len(self._q[0].keys) <= self._batch):
                total += len(self._q[0].keys)
                parts.append(self._q.popleft())
            for p in parts:
                p.tried = now
            self._busy = True
            return parts

    def _write(self, parts: list[_Part]) -> list[np.ndarray]:
        """Store the parts' pages in batches; per part, a mask of its pages stored and one of those tried.
        Once ``close`` abandons the queue, the batches not yet begun are left untried (the pages count as
        abandoned), so a job of many pages cannot hold the worker for long past the close's deadline."""
        keys = [k for p in parts for k in p.keys]
        pages = np.concatenate([p.pages for p in parts])
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
        for p in parts:
            end = off + len(p.keys)
            out.append(np.where(tried[off:end], ok[off:end], -1).astype(np.int8))  # 1 stored, 0 failed, -1 untried
            off = end
        return out

    def _settle(self, state: _State, pages: int) -> None:
        """Under the lock: ``pages`` of ``state``'s job are resolved; deliver it once none is left."""
        state.left -= pages
        if state.left == 0:
            self._done.append(state)

    def _give_up_oldest(self) -> None:
        """Under the lock: drop the oldest waiting retries until the retry queue holds at most its bound
        (``on_retry_dropped`` is told under the lock too: it must be quick)."""
        while self._retry_pages > self._retry_max and self._retry:
            p = self._retry.pop(0)
            n = len(p.keys)
            self._retry_pages -= n
            self.retry_dropped += n
            self.failed += n
            self._settle(p.state, n)
            if self._on_retry_dropped is not None:
                self._on_retry_dropped(n)

    def _finish(self, parts: list[_Part], results: list[np.ndarray]) -> None:
        """Under the lock: count what a batch did; failed pages wait for a retry (oldest first), untried ones
        (close abandoned them) are handed back."""
        now = self._clock()
        again: list[_Part] = []
        for p, res in zip(parts, results, strict=True):
            n = len(p.keys)
            if p.retry:
                self._retry_pages -= n
            else:
                self._queued_pages -= n  # room for blocked submitters, before any callback
            w = int((res == 1).sum())
            failed = np.flatnonzero(res == 0)
            untried = int((res == -1).sum())
            p.state.written += w
            self.written += w
            self.abandoned += untried
            self._settle(p.state, w + untried)
            if len(failed) == 0:
                continue
            if self._retry_max == 0 or self._closed:
                self.failed += len(failed)
                self._settle(p.state, len(failed))
                continue
            attempts = p.attempts + 1
            due = now + min(RETRY_MAX_S, RETRY_BASE_S * (1 << min(attempts - 1, 30)))
            if self._flushing and p.tried < max(self._flushing):
                due = now  # a flush waits for a try begun after it: no backoff
            again.append(_Part(p.state, [p.keys[i] for i in failed], p.pages[failed], True, attempts, due,
                               p.tried))
        if again:
            for p in again:  # in submission order, so that the oldest are the ones given up
                bisect.insort(self._retry, p, key=lambda q: q.state.seq)
            self._retry_pages += sum(len(p.keys) for p in again)
            self._give_up_oldest()

    def _run(self) -> None:
        while True:
            parts = self._take()
            if parts is None:
                break
            results = self._write(parts)
            with self._cv:
                self._finish(parts, results)
                self._busy = False
                self._cv.notify_all()
        with self._cv:  # abandoned at close: hand every queued and retrying job back
            for p in (*self._q, *self._retry):
                n = len(p.keys)
                self.abandoned += n
                if p.retry:
                    self._retry_pages -= n
                else:
                    self._queued_pages -= n
                self._settle(p.state, n)
            self._q.clear()
            self._retry.clear()
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
                state = self._done.popleft()
            try:
                state.job.on_done(state.written)
            except Exception:
                log.exception("writeback: on_done callback raised")
            with self._cv:
                self._undelivered -= 1
                self._cv.notify_all()

    def report(self) -> FlushReport:
        with self._cv:
            return FlushReport(self.written, self.failed + self._retry_pages, self.dropped,
                               self._queued_pages + self.abandoned)

    def flush(self, timeout_s: float | None = None) -> FlushReport:
        """Wait until the queue is empty and every page waiting for a retry has been tried once more (at
        once: their backoff is cut short), or ``timeout_s`` passes; report what was not written."""
        with self._cv:
            start = self._clock()
            for p in self._retry:
                p.due = min(p.due, start)
            self._flushing.append(start)
            self._cv.notify_all()

            def settled() -> bool:
                if self._q or self._busy or any(p.tried < start for p in self._retry):
                    return False
                waiting = {id(p.state) for p in self._retry}  # jobs whose last pages wait for a retry
                return self._undelivered == len(waiting) and not self._done

            try:
                self._cv.wait_for(settled, timeout=timeout_s)
            finally:
                self._flushing.remove(start)
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
