"""In-process L3 backend (``memory://``): a dict of framed pages. For tests and single-process runs.

Pages are stored framed exactly as the real backends store them, so corruption and foreign-namespace
pages are detected the same way.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from hicache.pool import HostPool
from hicache.storage.base import StorageBackend, StorageContext, register_backend
from hicache.storage.frame import FrameError, page_len, page_parts, unpack_page
from hicache.storage.pageio import PageBuffers, page_buffers


@register_backend("memory")
class MemoryBackend(StorageBackend):
    """Optional option ``capacity_pages``: oldest-first eviction beyond it."""

    scheme = "memory"

    def __init__(self, url: str, ctx: StorageContext, capacity_pages: int | None = None, **options: Any) -> None:
        super().__init__(url, ctx, **options)
        self._data: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.capacity_pages = capacity_pages

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._data:
                    break
                n += 1
            return n

    def batch_get(self, keys: Sequence[bytes], host_pool: HostPool | PageBuffers, host_indices: Sequence[int]) -> int:
        self._check_lengths(keys, host_indices)
        pio = page_buffers(host_pool)
        n = 0
        for key, page in zip(keys, host_indices, strict=True):
            with self._lock:
                blob = self._data.get(key)
            if blob is None:
                break
            dst = pio.target(int(page))
            try:
                stored = unpack_page(blob, self.ctx.namespace_digest, key, dst)
            except FrameError:
                self._count(corrupt_pages=1)
                break
            pio.commit(int(page), dst)
            n += 1
            self._count(bytes_read=pio.page_bytes, stored_bytes_read=stored)
        self._count(gets=n, get_misses=len(keys) - n)
        return n

    def batch_set(self, keys: Sequence[bytes], host_pool: HostPool | PageBuffers, host_indices: Sequence[int]) -> int:
        self._check_lengths(keys, host_indices)
        pio = page_buffers(host_pool)
        for key, page in zip(keys, host_indices, strict=True):
            header, stored = self.pack(pio.source(int(page)), key)
            blob = b"".join((header, *page_parts(stored)))
            with self._lock:
                self._data[key] = blob
                self._data.move_to_end(key)
                if self.capacity_pages is not None:
                    while len(self._data) > self.capacity_pages:
                        self._data.popitem(last=False)
            self._count(sets=1, bytes_written=pio.page_bytes, stored_bytes_written=page_len(stored))
        return len(keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            return sum(self._data.pop(k, None) is not None for k in keys)

    # test hooks -------------------------------------------------------------
    def raw(self, key: bytes) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def put_raw(self, key: bytes, blob: bytes) -> None:
        with self._lock:
            self._data[key] = blob

    def __len__(self) -> int:
        return len(self._data)
