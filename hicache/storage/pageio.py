"""Page buffers for L3 I/O: zero-copy views into a page-first host pool, a bounce buffer otherwise.

``HostPool.page_view`` builds a fresh tensor view per call (~15 us, as much as a 64 KiB page takes on
the wire); :class:`PageIO` builds one byte view of the whole pool per batch and slices it per page.
For a layer-first pool (a page is not contiguous) reads go through a bounce buffer and
:meth:`PageIO.commit` scatters it into the page.
"""

from __future__ import annotations

import torch

from hicache.pool import HostPool


class PageIO:
    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.page_bytes = pool.layout.bytes_per_page
        self.zero_copy = pool.host_layout == "page_first"
        self._rows = pool.buffer.view(torch.uint8).numpy().reshape(pool.num_pages, -1) if self.zero_copy else None

    def source(self, page: int) -> memoryview:
        """The page's bytes to send (a view when zero-copy, else a canonical page-first copy)."""
        if self._rows is not None:
            return memoryview(self._rows[page])
        return memoryview(self.pool.page_bytes(page))

    def target(self, page: int) -> memoryview:
        """Where to receive the page's bytes: the page itself, or a bounce buffer."""
        if self._rows is not None:
            return memoryview(self._rows[page])
        return memoryview(bytearray(self.page_bytes))

    def commit(self, page: int, received: memoryview) -> None:
        """Make a verified ``target`` the page's content (a no-op when it was the page itself)."""
        if self._rows is None:
            self.pool.write_page_bytes(page, received)
