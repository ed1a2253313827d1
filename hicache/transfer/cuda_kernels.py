"""Run-time compiled page gather/scatter kernels (``kernels/page_copy.cu`` through CuPy ``RawModule``).

Installing needs no build step: the CUDA source ships as package data (``hicache/kernels``, a link to the
repository's top-level ``kernels/``) and is compiled by NVRTC on first use; CuPy caches the binary on disk
and this module caches the loaded module per device.

:class:`KernelCopier` launches the copy for one slot range (one layer, or every layer) of a page list.
It needs a GPU and CuPy; importing this module does not (CuPy is imported on first use).
"""

from __future__ import annotations

import math
import struct
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hicache.transfer.cuda_driver import KernelLauncher

SOURCE_NAME = "page_copy.cu"
VECTOR_WIDTHS = (16, 8, 4, 2, 1)
# Smallest grids measured to fill a PCIe Gen5 x16 link on an H200 (1024 threads per block): reading host
# memory (loads) reaches 92% of the ceiling from 2 blocks (1: 57%, 4 and 8: 92%), writing it (backups)
# 95% at 2. More blocks only take SMs away from attention.
DEFAULT_LOAD_BLOCKS = 2
DEFAULT_BACKUP_BLOCKS = 2
DEFAULT_BLOCKS = DEFAULT_BACKUP_BLOCKS
# The staged path's kernel copies device memory to device memory: a short burst on a few SMs per slot.
DEFAULT_STAGE_BLOCKS = 8
DEFAULT_THREADS = 1024
UNROLL = 8  # PAGE_COPY_UNROLL in the source: vectors each thread has in flight
FETCH_THREADS = 256  # fetch_indices: index arrays are small; a few blocks read them over the link
FETCH_MAX_BLOCKS = 16
ITEMS_FLAG = 2  # PAGE_COPY_ITEMS in the source: a device-to-device backup walks work items, as loads do

# Parameter lists of the kernels, as the driver lays them out (native alignment): used to pack the
# arguments of a driver-API launch, and to type them for a CuPy launch.
PAGE_COPY_ARGS = struct.Struct("@QQqqQQqiiqi")
LOAD_LAYERS_ARGS = struct.Struct("@QQqqQQqiiqQQI")
FETCH_ARGS = struct.Struct("@QQq")
RESIDENT_ARGS = struct.Struct("@QqQiQQQQQQiQIi")
STAGED_DESC_WORDS = 8  # int64 words per chunk descriptor of staged_resident (see the source)
# Blocks of a resident staged kernel: it holds them for the whole transfer, so as few as keep a
# device-to-device copy well ahead of the link.
DEFAULT_RESIDENT_BLOCKS = 2
_NUMPY_OF = {"Q": np.uint64, "q": np.int64, "i": np.int32, "I": np.uint32}

_modules: dict[int, Any] = {}
_lock = threading.Lock()


def kernel_source_path() -> Path:
    """The CUDA source: package data first (installed), then the repository's ``kernels/``."""
    here = Path(__file__).resolve().parent.parent  # hicache/
    for cand in (here / "kernels" / SOURCE_NAME, here.parent / "kernels" / SOURCE_NAME):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"CUDA source {SOURCE_NAME} not found in {here / 'kernels'} or {here.parent / 'kernels'}")


def _module(device_index: int) -> Any:
    import cupy

    with _lock:
        mod = _modules.get(device_index)
        if mod is None:
            src = kernel_source_path().read_text()
            with cupy.cuda.Device(device_index):
                mod = cupy.RawModule(code=src, options=("--std=c++17",))
                for w in VECTOR_WIDTHS:  # compile and load now, not inside a timed region
                    mod.get_function(f"page_copy_{w}")
                    mod.get_function(f"page_load_layers_{w}")
                    mod.get_function(f"staged_resident_{w}")
                mod.get_function("fetch_indices")
            _modules[device_index] = mod
        return mod


def vector_width(piece_bytes: int, *addresses_and_strides: int) -> int:
    """Widest vector (16/8/4/2/1 bytes) dividing the piece size and every address and stride."""
    g = piece_bytes
    for a in addresses_and_strides:
        g = math.gcd(g, int(a))
    for w in VECTOR_WIDTHS:
        if g % w == 0:
            return w
    return 1


@dataclass(frozen=True)
class CopyGeometry:
    """Addresses of one device pool / host pool pair, as the kernel sees them (bytes).

    ``dev_ptrs[lc]`` is the base of ``kv[layer][k]`` with ``lc = layer * C + k``; ``host_base`` the
    device-visible address of the host buffer.
    """

    dev_ptrs: tuple[int, ...]
    host_base: int
    host_page_stride: int
    host_lc_stride: int
    piece_bytes: int
    num_lc: int


class KernelCopier:
    """Launches page copies on a given stream with a capped grid.

    ``blocks`` x ``threads`` is the most the kernel ever uses; a small copy gets fewer blocks. The engine
    uses one copier per direction (``blocks``), one for the staged path's device-side copies
    (``stage_blocks``) and, where ``load_head_layers`` > 0, one for head layers (``head_blocks``).
    """

    def __init__(self, geometry: CopyGeometry, device_index: int, blocks: int = DEFAULT_BLOCKS,
                 threads: int = DEFAULT_THREADS) -> None:
        import cupy
        import torch

        if blocks < 1:
            raise ValueError(f"blocks: must be >= 1, got {blocks}")
        if threads < 32 or threads > 1024 or threads % 32:
            raise ValueError(f"threads: must be a multiple of 32 in [32, 1024], got {threads}")
        self.geometry = geometry
        self.device_index = device_index
        self.blocks = blocks
        self.threads = threads
        g = geometry
        self.width = vector_width(g.piece_bytes, g.host_base, g.host_page_stride, g.host_lc_stride, *g.dev_ptrs)
        self.piece_vecs = g.piece_bytes // self.width
        self._module = _module(device_index)
        self._kernel = self._module.get_function(f"page_copy_{self.width}")
        self._layers_kernel = self._module.get_function(f"page_load_layers_{self.width}")
        self._fetch_kernel = self._module.get_function("fetch_indices")
        self._resident_kernel = self._module.get_function(f"staged_resident_{self.width}")
        # never ask for more threads than a kernel can take
        for k in (self._kernel, self._layers_kernel, self._resident_kernel):
            self.threads = min(self.threads, int(getattr(k, "max_threads_per_block", self.threads)))
        self._cupy = cupy
        self._dev_ptrs = torch.tensor(np.array(g.dev_ptrs, dtype=np.uint64).view(np.int64),
                                      device=f"cuda:{device_index}")
        self._streams: dict[int, Any] = {}
        self._launcher: KernelLauncher | None = None
        self._context = 0
        self._fn_ptrs: dict[int, int] = {}
        self.driver_error: str | None = None  # why kernels are launched through CuPy, when they are
        try:
            launcher = KernelLauncher.get()
            with cupy.cuda.Device(device_index):
                torch.cuda.current_stream(device_index).synchronize()  # the device's context is current
                self._context = launcher.current_context()
                # RawKernel.kernel is the Function loaded on the current device; .ptr its CUfunction
                self._fn_ptrs = {id(k): int(getattr(getattr(k, "kernel", k), "ptr", 0) or 0)
                                 for k in (self._kernel, self._layers_kernel, self._fetch_kernel,
                                           self._resident_kernel)}
            if not self._context:
                raise RuntimeError("no current CUDA context")
            if not all(self._fn_ptrs.values()):
                raise RuntimeError("CuPy gives no CUfunction handle")
            self._launcher = launcher
            self._self_test(torch)
        except (OSError, RuntimeError, AttributeError, TypeError, ValueError) as e:
            self._launcher = None  # CuPy launches instead
            self.driver_error = f"{type(e).__name__}: {e}"

    def _self_test(self, torch: Any) -> None:
        """Run each kernel once through the driver on scratch buffers and check what it copied.

        ``page_copy`` and ``page_load_layers`` copy one piece from a scratch "host" buffer (device memory:
        the kernels only see addresses) into a scratch "pool" slot, with every argument in its real
        position; ``fetch_indices`` copies two indices. Raises ``RuntimeError`` on a failed launch or a
        wrong result, and then the copier launches through CuPy instead.
        """
        dev = f"cuda:{self.device_index}"
        n = self.geometry.piece_bytes
        src = torch.arange(n, dtype=torch.int32, device=dev).to(torch.uint8)
        outs = [torch.zeros(n, dtype=torch.uint8, device=dev) for _ in range(2)]
        ptrs = [torch.tensor([o.data_ptr()], dtype=torch.int64, device=dev) for o in outs]
        idx_src = torch.tensor([0, 0], dtype=torch.int64, device=dev)
        idx = torch.full((2,), -1, dtype=torch.int64, device=dev)
        sync = torch.zeros(2, dtype=torch.int32, device=dev)  # counter, flag
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        h = stream.cuda_stream
        self._run(self._fetch_kernel, 1, 32, h, FETCH_ARGS, idx_src.data_ptr(), idx.data_ptr(), 2)
        self._run(self._kernel, 1, self.threads, h, PAGE_COPY_ARGS, ptrs[0].data_ptr(), src.data_ptr(), n, 0,
                  idx.data_ptr(), idx.data_ptr() + 8, 1, 0, 1, self.piece_vecs, 0)
        self._run(self._layers_kernel, 1, self.threads, h, LOAD_LAYERS_ARGS, ptrs[1].data_ptr(), src.data_ptr(),
                  n, 0, idx.data_ptr(), idx.data_ptr() + 8, 1, 1, 1, self.piece_vecs, sync.data_ptr(),
                  sync.data_ptr() + 4, 7)
        stream.synchronize()
        if not (idx.tolist() == [0, 0] and torch.equal(outs[0], src) and torch.equal(outs[1], src)
                and sync.tolist() == [0, 7]):
            raise RuntimeError("driver launch self-test: a kernel copied the wrong data")

    @property
    def launches_by_driver(self) -> bool:
        """True when kernels are launched through ``cuLaunchKernel`` directly (else through CuPy)."""
        return self._launcher is not None

    def _run(self, kernel: Any, grid: int, block: int, stream_handle: int, fmt: struct.Struct,
             *args: int) -> None:
        """Launch ``kernel`` with ``args`` (Python ints typed by ``fmt``) on ``stream_handle``."""
        if self._launcher is not None:
            self._launcher.launch(self._fn_ptrs[id(kernel)], self._context, grid, block, stream_handle, fmt, *args)
            return
        typed = tuple(_NUMPY_OF[c](a) for c, a in zip(fmt.format.lstrip("@"), args, strict=True))
        with self._cupy.cuda.Device(self.device_index), self._ext_stream(stream_handle):
            kernel((grid,), (block,), typed)

    def _ext_stream(self, handle: int) -> Any:
        s = self._streams.get(handle)
        if s is None:
            with warnings.catch_warnings():  # newer CuPy deprecates ExternalStream; it still works
                warnings.simplefilter("ignore", DeprecationWarning)
                s = self._cupy.cuda.ExternalStream(handle, self.device_index)
            self._streams[handle] = s
        return s

    def grid_for(self, n_pages: int, n_lc: int, to_host: bool = False) -> int:
        """Blocks for a copy: no more than its work fills (see the kernel source), at most ``blocks``."""
        if to_host:  # flat vector range, UNROLL vectors per thread
            total = n_pages * n_lc * self.piece_vecs
            return max(1, min(self.blocks, -(-total // (self.threads * UNROLL))))
        chunk = 32 * UNROLL  # vectors of one warp's work item
        items = n_pages * n_lc * -(-self.piece_vecs // chunk)
        return max(1, min(self.blocks, -(-items * 32 // self.threads)))

    def fetch_indices(self, stream_handle: int, src_host_ptr: int, dst_ptr: int, n: int) -> None:
        """Copy ``n`` int64 from pinned host memory (``src_host_ptr``, device-visible) to device memory
        ``dst_ptr`` with a small kernel on ``stream_handle``.

        Not a copy-engine memcpy: that would queue behind bulk DMA already in flight in the same
        direction, so a backup submitted during a large load would wait for the load to drain.
        """
        if n <= 0:
            return
        grid = max(1, min(FETCH_MAX_BLOCKS, -(-n // FETCH_THREADS)))
        self._run(self._fetch_kernel, grid, FETCH_THREADS, stream_handle, FETCH_ARGS, src_host_ptr, dst_ptr, n)

    def launch(self, stream_handle: int, dev_idx_ptr: int, host_idx_ptr: int, n_pages: int,
               lc_begin: int, n_lc: int, to_host: bool) -> None:
        """Copy ``n_lc`` slots from ``lc_begin`` of ``n_pages`` page pairs; index arrays are device int64."""
        if n_pages <= 0 or n_lc <= 0:
            return
        if lc_begin < 0 or lc_begin + n_lc > self.geometry.num_lc:
            raise ValueError(f"slot range [{lc_begin}, {lc_begin + n_lc}) outside [0, {self.geometry.num_lc})")
        g = self.geometry
        grid = self.grid_for(n_pages, n_lc, to_host)
        self._run(self._kernel, grid, self.threads, stream_handle, PAGE_COPY_ARGS,
                  self._dev_ptrs.data_ptr(), g.host_base, g.host_page_stride, g.host_lc_stride, dev_idx_ptr,
                  host_idx_ptr, n_pages, lc_begin, n_lc, self.piece_vecs, 1 if to_host else 0)

    def launch_staged(self, stream_handle: int, dev_idx_ptr: int, pos_idx_ptr: int, n_pages: int, lc_begin: int,
                      n_lc: int, to_host: bool, slot_base: int, lc_major: bool = False,
                      strides: tuple[int, int] | None = None) -> None:
        """Copy between the L1 pool and a device staging slot laid out ``[n_pages, n_lc, piece]``
        (``lc_major``: ``[n_lc, n_pages, piece]``, see :func:`hicache.transfer.staged_plan.plan_group_lc`;
        ``strides``: any (page, lc) byte strides, e.g. the block-mirrored slots of
        :func:`hicache.transfer.staged_plan_blocks.plan_group_blocks`, page keys in ``pos_idx``).

        Page ``i`` of the slot (``pos_idx[i]``, normally ``i``) pairs with L1 page ``dev_idx[i]``;
        ``to_host`` copies L1 -> slot. The slot is addressed like a page-first (lc-major: layer-first) host
        buffer whose pages hold just the ``n_lc`` slots from ``lc_begin``; its base must be aligned to the
        copier's vector width.
        """
        if n_pages <= 0 or n_lc <= 0:
            return
        if lc_begin < 0 or lc_begin + n_lc > self.geometry.num_lc:
            raise ValueError(f"slot range [{lc_begin}, {lc_begin + n_lc}) outside [0, {self.geometry.num_lc})")
        if slot_base % self.width:
            raise ValueError(f"staging slot base {slot_base:#x} not aligned to {self.width} bytes")
        piece = self.geometry.piece_bytes
        grid = self.grid_for(n_pages, n_lc)  # both directions walk work items (device memory only)
        if strides is not None:
            page_stride, lc_stride = strides
        else:
            page_stride, lc_stride = (piece, n_pages * piece) if lc_major else (n_lc * piece, piece)
        base = (slot_base - lc_begin * lc_stride) % (1 << 64)  # the kernel adds lc * lc_stride back
        self._run(self._kernel, grid, self.threads, stream_handle, PAGE_COPY_ARGS,
                  self._dev_ptrs.data_ptr(), base, page_stride, lc_stride, dev_idx_ptr, pos_idx_ptr, n_pages,
                  lc_begin, n_lc, self.piece_vecs, (1 if to_host else 0) | ITEMS_FLAG)

    def launch_load_layers(self, stream_handle: int, dev_idx_ptr: int, host_idx_ptr: int, n_pages: int,
                           n_layers: int, kv_count: int, counters_ptr: int, flags_ptr: int, seq: int) -> None:
        """Load every layer in one launch; ``flags[layer]`` becomes ``seq`` once that layer has landed.

        ``counters`` (uint32 per layer) must be zero; the kernel leaves them zero.
        """
        if n_pages <= 0:
            return
        if n_layers * kv_count != self.geometry.num_lc:
            raise ValueError(f"{n_layers} layers x {kv_count} != {self.geometry.num_lc} slots")
        g = self.geometry
        grid = self.grid_for(n_pages, kv_count)
        self._run(self._layers_kernel, grid, self.threads, stream_handle, LOAD_LAYERS_ARGS,
                  self._dev_ptrs.data_ptr(), g.host_base, g.host_page_stride, g.host_lc_stride, dev_idx_ptr,
                  host_idx_ptr, n_pages, n_layers, kv_count, self.piece_vecs, counters_ptr, flags_ptr, seq)

    def launch_resident(self, stream_handle: int, blocks: int, desc_ptr: int, n_chunks: int, dev_idx_ptr: int,
                        pos_idx_ptr: int, slot_ready_ptr: int, slot_done_ptr: int, counters_ptr: int,
                        layer_chunk_ptr: int, n_layers: int, layer_flags_ptr: int, layer_seq: int,
                        to_host: bool) -> None:
        """A whole staged transfer's device-side copies in one resident launch of ``blocks`` blocks.

        ``desc`` (device int64, ``STAGED_DESC_WORDS`` per chunk) lists the chunks in order; the kernel
        waits for ``slot_ready``, copies, publishes ``slot_done`` and, for loads, the per-layer flags of
        ``layer_chunk`` (device int32 per layer, ``n_layers`` of them; 0 for backups). ``counters``
        (uint32 per slot) must be zero; the kernel leaves them zero. See ``staged_resident`` in the source.
        """
        if n_chunks <= 0:
            return
        self._run(self._resident_kernel, max(1, blocks), self.threads, stream_handle, RESIDENT_ARGS,
                  self._dev_ptrs.data_ptr(), self.piece_vecs, desc_ptr, n_chunks, dev_idx_ptr, pos_idx_ptr,
                  slot_ready_ptr, slot_done_ptr, counters_ptr, layer_chunk_ptr, n_layers, layer_flags_ptr,
                  layer_seq, 1 if to_host else 0)
