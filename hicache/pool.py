"""Page pools: L1 (device, layer-first) and L2 (host, page-first, layer-first or block-first), with free-list
allocators.

Tensor shapes (P = pages, S = page_size, H = KV heads, D = head dim, L = layers, C = 2 for MHA / 1 for MLA,
B = pages per block):

* ``DevicePool.kv[layer][c]`` : ``[P, S, H, D]`` -- what paged attention reads (one K and one V per layer).
* ``HostPool`` page-first     : ``[P, L, C, S, H, D]`` -- one page is one contiguous object (L3 I/O).
* ``HostPool`` layer-first    : ``[L, C, P, S, H, D]``.
* ``HostPool`` block-first    : ``[P / B, L, C, B, S, H, D]`` -- layer-first within blocks of ``B``
  consecutive pages. One layer's K (or V) of a run of consecutive pages in a block is one contiguous
  run of host memory, so a layer-wise load of small pieces moves each layer as a few large DMA copies
  (the CUDA engine's staged path) instead of grouping layers; a page's bytes are ``L * C`` pieces
  ``B`` pieces apart. The allocator hands out runs of consecutive pages where it can.

All three are the same 7-D view ``[P / B, L, C, B, S, H, D]`` (``HostPool.blocks``): page-first is
``B = 1``, layer-first ``B = P``; page ``h`` is block ``h // B``, position ``h % B``.

The allocator hands out page indices; it knows which pages are free and which are out. Who holds an out
page (the tree, a request, a transfer in flight) is the cache's business; the cache's
``check_integrity`` proves free + cached + in flight == capacity.

An L2 pool is usually the largest allocation of the process (tens of GB), so ``HostPool`` checks its size
against :func:`available_host_memory` before allocating anything and raises :class:`HostMemoryError`
when it does not fit: where the kernel overcommits, an unpinned buffer that does not fit would be
granted anyway and the process killed later, as the cache fills.

Building a pool touches none of its memory: an unpinned L2 is ``torch.empty`` and a large L1 on the CPU
(zeros) is an anonymous mapping whose pages the kernel supplies, zeroed, on first write (:func:`host_zeros`,
advised for transparent huge pages), so start-up takes the same time at any size. Memory granted that way
is not taken yet when the next pool is checked, so the check also counts what lazily mapped pools alive in
this process may still take (:func:`lazy_host_bytes`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from hicache.layout import HOST_LAYOUTS, KVLayout

HostLayout = Literal["page_first", "layer_first", "block_first"]
# block-first's default block: the fewest pages (a power of two, at most MAX_BLOCK_PAGES) whose
# per-layer K or V run reaches the copy engine's full-rate copy size
BLOCK_RUN_BYTES = 64 << 10
MAX_BLOCK_PAGES = 64


# a memory cgroup limit at or above this is "no limit" (cgroup v1 writes 2**63 rounded down to a page)
_NO_CGROUP_LIMIT = 1 << 60
# a CPU L1 tensor at least this large is mapped lazily (host_zeros) instead of filled with zeros at once
LAZY_MIN_BYTES = 1 << 20

_lazy_lock = threading.Lock()
_lazy_bytes = 0  # host memory lazily mapped pools alive in this process were granted (lazy_host_bytes)


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units, e.g. ``32.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


class HostMemoryError(MemoryError):
    """A host pool does not fit in the memory this process can get.

    ``needed`` is the buffer's size in bytes; ``available`` what the system said it could spare when it
    was checked (None when the check passed, or could not be made, and the allocation itself failed,
    ``detail`` saying why).
    """

    def __init__(self, needed: int, available: int | None, detail: str = "") -> None:
        self.needed = needed
        self.available = available
        self.detail = detail
        if available is not None:
            what = f"only {format_bytes(available)} ({available} bytes) is available"
        else:
            what = f"the allocation failed ({detail or 'out of memory'})"
        super().__init__(f"host pool: {format_bytes(needed)} ({needed} bytes) asked for, {what}")


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """Linux's MemAvailable (free memory plus what it can reclaim without swapping), in bytes. Kernels
    before 3.14 do not report it: then free memory plus the file cache and reclaimable slab, the same
    sum without the kernel's reserves (free memory alone would count the page cache as taken)."""
    fields: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemAvailable", "MemFree", "Active(file)", "Inactive(file)", "SReclaimable"):
                    fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" in fields:
        return fields["MemAvailable"]
    if "MemFree" not in fields:
        return None
    return sum(fields.values())


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup (v2, or v1's ``memory`` controller) and its ancestors can still
    grant, or None when none sets a limit: limit minus usage, plus the inactive file cache the kernel
    reclaims before it kills anything (what container runtimes count as the working set)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        parts = line.split(":", 2)  # hierarchy id : controllers : path
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2's unified hierarchy: "0::/path"
            mount, limit_f, usage_f, reclaim = Path(root), "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            mount, limit_f, usage_f, reclaim = (Path(root) / "memory", "memory.limit_in_bytes",
                                                "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        rel = Path(path.strip() or "/").relative_to("/")
        # the process's own cgroup and each one above it; in a container whose cgroup is mounted as the
        # root, the path names the host's view and only the mount itself exists
        for d in [mount / rel, *(mount / rel).parents]:
            if not d.is_relative_to(mount):
                break
            limit = _read_int(d / limit_f)
            usage = _read_int(d / usage_f)
            if limit is None or usage is None or limit >= _NO_CGROUP_LIMIT:
                continue
            room = max(0, limit - usage + _stat_value(d / "memory.stat", reclaim))
            best = room if best is None else min(best, room)
    return best


def available_host_memory() -> int | None:
    """Bytes of host memory this process can still get, or None when the system does not say.

    Linux's MemAvailable, capped by the memory cgroup's headroom where a container or service sets a
    limit (:func:`_cgroup_headroom`); elsewhere the free physical pages ``os.sysconf`` reports.
    """
    avail = _meminfo_available()
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # not every system names these
            avail = None
    room = _cgroup_headroom()
    if avail is None or room is None:
        return avail if room is None else room
    return min(avail, room)


def lazy_host_bytes() -> int:
    """Bytes of host memory granted to lazily mapped pools alive in this process (:func:`host_zeros`,
    :func:`reserve_host_memory`): what they may still take as they fill, counted whole (a pool's pages
    already touched are counted by :func:`available_host_memory` too, so a pool built beside a full one
    is judged conservatively)."""
    return _lazy_bytes


def _unreserve(nbytes: int) -> None:
    global _lazy_bytes
    with _lazy_lock:
        _lazy_bytes -= nbytes


def reserve_host_memory(owner: object, nbytes: int) -> None:
    """Count ``nbytes`` in :func:`lazy_host_bytes` until ``owner`` (the object whose lifetime is the
    memory's: an ``mmap``, a shared memory segment) is collected."""
    global _lazy_bytes
    with _lazy_lock:
        _lazy_bytes += nbytes
    weakref.finalize(owner, _unreserve, nbytes)


def host_zeros(nbytes: int) -> torch.Tensor:
    """A flat ``uint8`` tensor of ``nbytes`` zero bytes of host memory, none of them touched: an anonymous
    private mapping whose pages the kernel supplies, zeroed, on first write (in huge pages where
    transparent huge pages are on for ``madvise``). Costs no time and no memory until written; counted in
    :func:`lazy_host_bytes` while the memory lives. :class:`HostMemoryError` when the system refuses the
    mapping."""
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    except (OSError, OverflowError, ValueError) as e:
        raise HostMemoryError(nbytes, None, str(e)) from e
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # a kernel without transparent huge pages refuses: small pages, as without the advice
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE)
    reserve_host_memory(m, nbytes)
    return torch.frombuffer(m, dtype=torch.uint8)


def default_block_pages(piece_bytes: int) -> int:
    """Pages per block of a block-first pool of ``piece_bytes`` pieces (see ``BLOCK_RUN_BYTES``)."""
    b = 1
    while b * piece_bytes < BLOCK_RUN_BYTES and b < MAX_BLOCK_PAGES:
        b *= 2
    return b


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
        """Pages not handed out."""
        return self._n_free

    @property
    def used_pages(self) -> int:
        """Pages handed out and not freed yet."""
        return self.capacity - self._n_free

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` free page indices (int64), or None when fewer are free; ``ValueError`` for ``n < 0``."""
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
        """Return pages to the free list; ``ValueError`` (nothing freed) for an index out of range, not
        allocated, or repeated."""
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
        """Bool per index: handed out now. ``IndexError`` for an index outside ``[0, capacity)``."""
        i = np.asarray(idx, dtype=np.int64)
        if i.size and (i.min() < 0 or i.max() >= self.capacity):
            raise IndexError(f"page index out of range [0, {self.capacity})")
        with self._lock:
            return self._out[i]

    def allocated(self) -> np.ndarray:
        """Indices of every page handed out, ascending."""
        with self._lock:
            return np.flatnonzero(self._out)

    def check_integrity(self) -> None:
        """``AssertionError`` unless free + allocated == capacity with no page in both or listed twice."""
        with self._lock:
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
            [self._zeros(shape, layout.torch_dtype) for _ in range(layout.kv_count)] for _ in range(layout.num_layers)
        ]

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor on the pool's device; a large one on the CPU is mapped lazily (:func:`host_zeros`):
        filling gigabytes with zeros page by page is what made start-up grow with the pool."""
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        if self.device.type != "cpu" or nbytes < LAZY_MIN_BYTES:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        return host_zeros(nbytes).view(dtype).view(shape)

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
        """Bytes of the pool's pages, every layer (``num_pages * layout.bytes_per_page``)."""
        return self.num_pages * self.layout.bytes_per_page

    def page_tensor(self, layer: int, c: int) -> torch.Tensor:
        """``[P, S, H, D]`` tensor of layer ``layer``'s K (c=0) / V (c=1), or MLA latent (c=0), over every
        page (no copy)."""
        return self.kv[layer][c]


class HostPool:
    """L2: host page tensor, pinned when CUDA is present, page-first by default.

    ``block_pages`` (block-first only; 0 picks :func:`default_block_pages`) is the block size ``B``;
    the buffer holds whole blocks, so its last block may have pages past ``num_pages`` that are never
    handed out. ``host_keys`` maps page indices to the piece offsets the copy planners and kernels use.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        host_layout: HostLayout = "page_first",
        pin_memory: bool | None = None,
        block_pages: int = 0,
    ) -> None:
        if host_layout not in HOST_LAYOUTS:
            raise ValueError(f"host_layout: must be one of {HOST_LAYOUTS}, got {host_layout!r}")
        if block_pages < 0:
            raise ValueError(f"block_pages: must be >= 0, got {block_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.host_layout: HostLayout = host_layout
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        L, C, (S, H, D) = layout.num_layers, layout.kv_count, layout.page_shape
        if host_layout == "page_first":
            self.block_pages = 1
            shape: tuple[int, ...] = (num_pages, L, C, S, H, D)
        elif host_layout == "layer_first":
            self.block_pages = num_pages
            shape = (L, C, num_pages, S, H, D)
        else:
            self.block_pages = block_pages or default_block_pages(layout.bytes_per_layer_piece)
            shape = (-(-num_pages // self.block_pages), L, C, self.block_pages, S, H, D)
        self.num_blocks = -(-num_pages // self.block_pages)
        # checked before the allocator's arrays and the buffer exist, so a pool that cannot fit costs nothing
        needed = self.num_blocks * self.block_pages * layout.bytes_per_page
        available = available_host_memory()
        if available is not None:  # less what lazily mapped pools (an L1 on the CPU) may still take
            available = max(0, available - lazy_host_bytes())
        if available is not None and needed > available:
            raise HostMemoryError(needed, available)
        self.allocator = PageAllocator(num_pages)
        try:
            self.buffer = torch.empty(shape, dtype=layout.torch_dtype, pin_memory=pin_memory)
        except (RuntimeError, MemoryError) as e:  # the allocator's or the CUDA driver's "out of memory"
            if not isinstance(e, MemoryError) and "memory" not in str(e).lower():
                raise  # not a size problem (a CUDA start-up failure, ...): say what it is, not "too large"
            raise HostMemoryError(needed, None, (str(e).strip().splitlines() or [""])[0]) from e
        self.pinned = pin_memory
        # [P / B, L, C, B, S, H, D] over the same memory, for every layout
        self.blocks = self.buffer.view(self.num_blocks, L, C, self.block_pages, S, H, D)

    @property
    def nbytes(self) -> int:
        """Bytes of ``num_pages`` pages; a block-first buffer's last block may add unused pages."""
        return self.num_pages * self.layout.bytes_per_page

    @property
    def piece_strides(self) -> tuple[int, int]:
        """``(page, lc)`` strides in pieces between ``host_keys`` units: the piece of page ``h``, layer
        ``l``, K/V ``c`` is ``host_keys(h) * page + (l * C + c) * lc`` pieces into the buffer."""
        L, C = self.layout.num_layers, self.layout.kv_count
        if self.host_layout == "page_first":
            return L * C, 1
        return 1, self.block_pages

    def host_keys(self, pages: np.ndarray) -> np.ndarray:
        """Each page's offset key (int64): the page index for page-first and layer-first pools; for
        block-first, its offset in pieces, ``(h // B) * L * C * B + h % B``, so that consecutive pages in
        a block have consecutive keys (:attr:`piece_strides` is then ``(1, B)``)."""
        h = np.asarray(pages, dtype=np.int64)
        if self.host_layout != "block_first":
            return h
        B = self.block_pages
        span = self.layout.num_layers * self.layout.kv_count * B
        return (h // B) * span + h % B

    def _pieces(self, layer: int, c: int) -> torch.Tensor:
        return self.blocks.view(torch.uint8)[:, layer, c]  # [P / B, B, S, H, D * element size]

    def read_pieces(self, layer: int, c: int, pages: torch.Tensor) -> torch.Tensor:
        """The bytes (``uint8 [n, S, H, D * element size]``, a copy) of layer ``layer``'s K (c=0) / V (c=1)
        of ``pages`` (int64 tensor). Bytes, so that every dtype copies exactly (float8 included)."""
        B = self.block_pages
        return self._pieces(layer, c)[pages // B, pages % B]

    def write_pieces(self, layer: int, c: int, pages: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` (bytes as :meth:`read_pieces` returns them) into layer ``layer``'s K / V of
        ``pages`` (int64 tensor)."""
        B = self.block_pages
        self._pieces(layer, c)[pages // B, pages % B] = src

    def layer_view(self, layer: int, c: int) -> torch.Tensor:
        """``[P, S, H, D]`` view of one layer's K (c=0) / V (c=1) across all pages (strided if page-first).
        Page-first and layer-first only: a block-first layer is not one view (``ValueError``)."""
        if self.host_layout == "page_first":
            return self.buffer[:, layer, c]
        if self.host_layout == "layer_first":
            return self.buffer[layer, c]
        raise ValueError("layer_view: a block-first pool has no single view of a layer; use read_pieces")

    def _page(self, page: int) -> torch.Tensor:
        return self.blocks[page // self.block_pages, :, :, page % self.block_pages]  # [L, C, S, H, D]

    def page_bytes(self, page: int) -> bytes:
        """One page's bytes in canonical page-first order ``[L, C, S, H, D]`` (L3 payload)."""
        return self._page(page).contiguous().view(torch.uint8).numpy().tobytes()

    def page_view(self, page: int) -> memoryview:
        """Zero-copy view of one page's bytes (page-first only; other layouts raise ValueError)."""
        if self.host_layout != "page_first":
            raise ValueError("page_view: zero-copy page views need host_layout='page_first'")
        return memoryview(self.buffer[page].view(torch.uint8).numpy().reshape(-1).data)

    def write_page_bytes(self, page: int, data: bytes | memoryview) -> None:
        """Fill one page from canonical page-first bytes; ``ValueError`` when the size is wrong."""
        if len(data) != self.layout.bytes_per_page:
            raise ValueError(f"page payload is {len(data)} bytes, layout needs {self.layout.bytes_per_page}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.layout.torch_dtype)
        L, C, (S, H, D) = self.layout.num_layers, self.layout.kv_count, self.layout.page_shape
        self._page(page).copy_(src.view(L, C, S, H, D))

    def release(self) -> None:
        """Drop the buffer (unpins it) so a long-lived process does not keep tens of GB pinned."""
        self.buffer = torch.empty(0, dtype=self.layout.torch_dtype)
        self.blocks = self.buffer
