"""Page pools: L1 (device, layer-first) and L2 (host, page-first or layer-first), with free-list allocators.

Tensor shapes (P = pages, S = page_size, H = KV heads, D = head dim, L = layers, C = 2 for MHA / 1 for MLA):

* ``DevicePool.kv[layer][c]`` : ``[P, S, H, D]`` -- what paged attention reads (one K and one V per layer).
* ``HostPool`` page-first     : ``[P, L, C, S, H, D]`` -- one page is one contiguous object (L3 I/O).
* ``HostPool`` layer-first    : ``[L, C, P, S, H, D]``.

The allocator hands out page indices; it knows which pages are free and which are out. Who holds an out
page (the tree, a request, a transfer in flight) is the cache's business; the cache's
``check_integrity`` proves free + cached + in flight == capacity.
"""

from __future__ import annotations

import threading
from typing import Literal

import numpy as np
import torch

from hicache.layout import KVLayout

HostLayout = Literal["page_first", "layer_first"]


class PageAllocator:
    """Free-list allocator of page indices ``[0, capacity)``. Thread-safe.

    ``alloc(n)`` returns ``n`` distinct free indices or None (never a partial allocation); ``free``
    rejects indices that are out of range or not allocated (a double free is an error, not a no-op).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1 page, got {capacity}")
        self.capacity = capacity
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # stack; pop from the end
        self._n_free = capacity
        self._out = np.zeros(capacity, dtype=bool)
        self._lock = threading.Lock()

    @property
    def free_pages(self) -> int:
        return self._n_free

    @property
    def used_pages(self) -> int:
        return self.capacity - self._n_free

    def alloc(self, n: int) -> np.ndarray | None:
        if n < 0:
            raise ValueError(f"alloc: n must be >= 0, got {n}")
        with self._lock:
            if n > self._n_free:
                return None
            out = self._free[self._n_free - n : self._n_free][::-1].copy()
            self._n_free -= n
            self._out[out] = True
            return out

    def free(self, idx: np.ndarray) -> None:
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0:
            return
        with self._lock:
            if idx.min() < 0 or idx.max() >= self.capacity:
                raise ValueError(f"free: page index out of range [0, {self.capacity})")
            if not self._out[idx].all() or len(np.unique(idx)) != len(idx):
                raise ValueError("free: page not allocated (double free?)")
            self._out[idx] = False
            self._free[self._n_free : self._n_free + len(idx)] = idx[::-1]
            self._n_free += len(idx)

    def is_allocated(self, idx: np.ndarray) -> np.ndarray:
        return self._out[np.asarray(idx, dtype=np.int64)]

    def allocated(self) -> np.ndarray:
        return np.flatnonzero(self._out)

    def check_integrity(self) -> None:
        free = self._free[: self._n_free]
        assert len(np.unique(free)) == self._n_free, "free list holds duplicates"
        assert not self._out[free].any(), "a free page is marked allocated"
        assert int(self._out.sum()) + self._n_free == self.capacity, "free + allocated != capacity"


class DevicePool:
    """L1: layer-first K/V (or MLA latent) page tensors on ``device``."""

    buffer: torch.Tensor | None = None  # the flat memory behind kv when built by from_buffer

    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages)
        shape = (num_pages, *layout.page_shape)
        # kv[layer][c]: [P, S, H, D]
        self.kv: list[list[torch.Tensor]] = [
            [torch.zeros(shape, dtype=layout.torch_dtype, device=self.device) for _ in range(layout.kv_count)]
            for _ in range(layout.num_layers)
        ]

    @classmethod
    def from_buffer(cls, layout: KVLayout, num_pages: int, buffer: torch.Tensor) -> DevicePool:
        """A pool over caller-owned memory: ``buffer`` is a contiguous uint8 tensor of exactly
        ``num_pages * layout.bytes_per_page`` bytes (shared memory, a CUDA IPC-exportable allocation),
        viewed as ``[L, C, P, S, H, D]`` so ``kv[layer][c] = view[layer, c]`` (no copy). The caller keeps
        the memory alive as long as the pool."""
        need = num_pages * layout.bytes_per_page
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError("from_buffer: buffer must be a flat contiguous uint8 tensor")
        if buffer.numel() != need:
            raise ValueError(f"from_buffer: buffer has {buffer.numel()} bytes, {num_pages} pages need {need}")
        pool = cls.__new__(cls)
        pool.layout = layout
        pool.num_pages = num_pages
        pool.device = buffer.device
        pool.allocator = PageAllocator(num_pages)
        view = buffer.view(layout.torch_dtype).view(layout.num_layers, layout.kv_count, num_pages,
                                                    *layout.page_shape)
        pool.kv = [[view[layer, c] for c in range(layout.kv_count)] for layer in range(layout.num_layers)]
        pool.buffer = buffer
        return pool

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.layout.bytes_per_page

    def page_tensor(self, layer: int, c: int) -> torch.Tensor:
        return self.kv[layer][c]


class HostPool:
    """L2: host page tensor, pinned when CUDA is present, page-first by default."""

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        host_layout: HostLayout = "page_first",
        pin_memory: bool | None = None,
    ) -> None:
        if host_layout not in ("page_first", "layer_first"):
            raise ValueError(f"host_layout: must be 'page_first' or 'layer_first', got {host_layout!r}")
        self.layout = layout
        self.num_pages = num_pages
        self.host_layout: HostLayout = host_layout
        self.allocator = PageAllocator(num_pages)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        L, C, (S, H, D) = layout.num_layers, layout.kv_count, layout.page_shape
        shape = (num_pages, L, C, S, H, D) if host_layout == "page_first" else (L, C, num_pages, S, H, D)
        self.buffer = torch.empty(shape, dtype=layout.torch_dtype, pin_memory=pin_memory)
        self.pinned = pin_memory

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.layout.bytes_per_page

    def layer_view(self, layer: int, c: int) -> torch.Tensor:
        """``[P, S, H, D]`` view of one layer's K (c=0) / V (c=1) across all pages (strided if page-first)."""
        if self.host_layout == "page_first":
            return self.buffer[:, layer, c]
        return self.buffer[layer, c]

    def page_bytes(self, page: int) -> bytes:
        """One page's bytes in canonical page-first order ``[L, C, S, H, D]`` (L3 payload)."""
        if self.host_layout == "page_first":
            t = self.buffer[page]
        else:
            t = self.buffer[:, :, page].contiguous()
        return t.view(torch.uint8).numpy().tobytes()

    def page_view(self, page: int) -> memoryview:
        """Zero-copy view of one page's bytes (page-first only; layer-first raises ValueError)."""
        if self.host_layout != "page_first":
            raise ValueError("page_view: zero-copy page views need host_layout='page_first'")
        return memoryview(self.buffer[page].view(torch.uint8).numpy().reshape(-1).data)

    def write_page_bytes(self, page: int, data: bytes | memoryview) -> None:
        """Fill one page from canonical page-first bytes; ``ValueError`` when the size is wrong."""
        if len(data) != self.layout.bytes_per_page:
            raise ValueError(f"page payload is {len(data)} bytes, layout needs {self.layout.bytes_per_page}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.layout.torch_dtype)
        L, C, (S, H, D) = self.layout.num_layers, self.layout.kv_count, self.layout.page_shape
        src = src.view(L, C, S, H, D)
        if self.host_layout == "page_first":
            self.buffer[page].copy_(src)
        else:
            self.buffer[:, :, page].copy_(src)

    def release(self) -> None:
        """Drop the buffer (unpins it) so a long-lived process does not keep tens of GB pinned."""
        self.buffer = torch.empty(0, dtype=self.layout.torch_dtype)
