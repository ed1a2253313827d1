"""The pages a file store (:mod:`hicache.storage.file_backend`) knows of, for its size cap (``max_bytes``).

An index of page path -> frame bytes, least recently used first: filled from a scan of the store (ordered
by file time), then kept up to date by the backend's own writes, deletes and reads (a read makes a page
the newest). Other nodes' writes and deletes only show at the next scan, which also forgets what reads
refreshed since. When the total passes the cap, the oldest pages are taken off the index for the backend
to delete. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable


class PageIndex:
    def __init__(self) -> None:
        self._pages: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.scanned_at = 0.0  # time.monotonic() of the last replace()

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    def replace(self, pages: Iterable[tuple[str, int]]) -> None:
        """The index is ``pages`` (path, bytes), oldest first: what a scan of the store found."""
        fresh = OrderedDict(pages)
        with self._lock:
            self._pages = fresh
            self._bytes = sum(fresh.values())
            self.scanned_at = time.monotonic()

    def note(self, path: str, size: int) -> None:
        """A page written: now the newest."""
        with self._lock:
            old = self._pages.pop(path, None)
            self._bytes += size - (old or 0)
            self._pages[path] = size

    def forget(self, path: str) -> None:
        with self._lock:
            old = self._pages.pop(path, None)
            if old is not None:
                self._bytes -= old

    def touch(self, path: str) -> None:
        """A page read: now the newest, if it is known."""
        with self._lock:
            if path in self._pages:
                self._pages.move_to_end(path)

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()
            self._bytes = 0

    def take_oldest(self, cap: int, down_to: int) -> list[str]:
        """If the pages pass ``cap`` bytes, take the oldest off the index until they are at most
        ``down_to``; their paths (none when within the cap)."""
        victims: list[str] = []
        with self._lock:
            if self._bytes <= cap:
                return victims
            while self._pages and self._bytes > down_to:
                p, s = self._pages.popitem(last=False)
                self._bytes -= s
                victims.append(p)
        return victims
