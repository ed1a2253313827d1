"""Page buffers for L3 I/O: where a backend reads a page's bytes from and writes them to.

A backend's ``batch_get`` / ``batch_set`` name pages by index into a :class:`PageBuffers`: hicache's own
L2 pool (wrapped by :func:`page_buffers` in a :class:`PageIO`) or an engine's host pool
(:class:`hicache.integrations.store.EngineBuffers`). A page is contiguous or a list of pieces
(:data:`hicache.storage.frame.PageBuf`); backends write and read the pieces as they are (``writev`` /
``readv``, one socket send per piece), so neither kind of pool is copied through a bounce buffer unless it
says so (``zero_copy`` false).

``HostPool.page_view`` builds a fresh tensor view per call (~15 us, as much as a 64 KiB page takes on
the wire); :class:`PageIO` builds one byte view of the whole pool per batch and slices it per page.
For a layer-first pool (a page is not contiguous in hicache's page order) reads go through a bounce
buffer and :meth:`PageIO.commit` scatters it into the page.
"""

from __future__ import annotations

import abc

import torch

from hicache.pool import HostPool
from hicache.storage.frame import PageBuf


class PageBuffers(abc.ABC):
    """Pages addressed by index. Contract: ``source(i)`` and ``target(i)`` are ``page_bytes`` long; a
    backend writes a page read from the store into ``target(i)`` and, once it is verified, calls
    ``commit(i, target)``; what it wrote there before a failed verification is undefined (the caller
    treats the page as not read). ``zero_copy``: ``target(i)`` is the page itself, so a backend may verify
    it after the bytes landed (a bounce buffer, by contrast, must be verified before ``commit``)."""

    page_bytes: int
    zero_copy: bool

    @abc.abstractmethod
    def source(self, page: int) -> PageBuf:
        """The page's bytes to store."""

    @abc.abstractmethod
    def target(self, page: int) -> PageBuf:
        """Where to receive the page's bytes."""

    def commit(self, page: int, received: PageBuf) -> None:  # noqa: B027 - a no-op when target is the page
        """Make a verified ``target`` the page's content."""


class PageIO(PageBuffers):
    """hicache's own L2 pool as :class:`PageBuffers` (pages in hicache's canonical page-first order)."""

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

    def commit(self, page: int, received: PageBuf) -> None:
        if self._rows is None:
            assert isinstance(received, memoryview)  # (target gave it)
            self.pool.write_page_bytes(page, received)


def page_buffers(pages: HostPool | PageBuffers) -> PageBuffers:
    """``pages`` as :class:`PageBuffers` (a host pool is wrapped)."""
    return pages if isinstance(pages, PageBuffers) else PageIO(pages)
