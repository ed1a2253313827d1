"""CUDA transfer engine: L2 (pinned host) <-> L1 (GPU) page copies on dedicated streams.

Usage::

    engine = create_engine("cuda", device_pool, host_pool, io_backend="kernel")   # or copy_engine / auto
    h = engine.load(host_idx, device_idx)      # returns at once
    for layer in range(L):
        h.wait_layer(layer)                     # the *current* stream waits on layer's event; no host sync
        attention(layer, ...)
    b = engine.backup(device_idx, host_idx)     # after the forward pass wrote those pages
    b.done()                                    # poll; b.wait() blocks the host until the pages are on L2

Streams and ordering:

* Loads run on one dedicated load stream, backups on one backup stream. Each submission first makes
  its stream wait on an event recorded on the caller's current (compute) stream, so a backup never
  reads a page the forward pass is still writing, and a load never overwrites a page that queued
  compute still reads.
* Per-layer readiness of a load, two mechanisms (``layer_signal``):

  - ``flags`` (kernel path, the default where the driver supports stream memory waits): the whole load
    is ONE kernel launch that walks the layers in order and publishes a per-layer flag;
    ``wait_layer(i)`` enqueues ``cuStreamWaitValue32(flag[i] >= seq)`` on the current stream. One
    launch matters: a copy kernel has to win SMs from running compute, and per-layer launches would
    have to win them once per layer.
  - ``events``: one launch (or one copy batch) per layer, each followed by an event;
    ``wait_layer(i)`` makes the current stream wait on event ``i``. The copy-engine path always uses
    this.

  Either way the host never blocks in ``wait_layer``.
* The load and backup streams have high priority, so a waiting copy kernel gets the next SMs freed.
* Loads and backups touching the same host or device pages are ordered against each other (a load of a
  host page that a running backup writes waits for that backup, and vice versa); otherwise the two
  streams run concurrently, one per link direction.
* Page index arrays reach the GPU through a small kernel reading pinned host memory, never a
  copy-engine memcpy: a memcpy queues behind bulk DMA already in flight in its direction, so a backup
  submitted during a large load would not start before the load's queued copies drained (measured on
  an H200 with staged 4 KiB pieces: load and backup at once fell to 0.52 or 0.67 of the bidirectional
  ceiling in some runs). The engine keeps the host arrays alive until the transfer completes.

I/O backends (``io_backend``):

* ``kernel``: the gather/scatter kernels of ``kernels/page_copy.cu`` read and write pinned host memory
  directly; grid capped at ``blocks`` x ``threads``. Default: 2 x 1024 each way, the smallest launch
  measured to reach the kernel's plateau on an H200 (92% of the link reading host memory, 95% writing
  it); more blocks only take SMs away from attention. ``blocks=N`` sets both.
* ``copy_engine``: DMA copies, runs merged, ``cudaMemcpyBatchAsync`` where available; uses no SMs.
  A backup's copies fan out over ``backup_streams`` streams (default 4), which keeps device-to-host
  DMA near a contiguous copy's rate while compute loads HBM.
* ``staged``: on a page-first host pool each page's bytes for a group of layers are contiguous on the
  host, so they move as one large DMA copy into a device staging slot, and a device-to-device kernel
  burst on a few SMs scatters them into the layer-first pool (backups: gather, then DMA). Small pieces
  then move at the copy engine's full rate. Loads go by groups of layers (the fewest whose run per page
  reaches ``ce_min_copy_bytes``); every layer of a group is ready at once. A load of several groups is
  staggered over ``stagger_ways`` parts of its pages (default 4), whose group boundaries are offset, so
  layers become ready about ``ways`` times as often (:func:`~hicache.transfer.stagger.stagger_schedule`).
  ``staging_bytes`` (default ``DEFAULT_STAGING_BYTES``, 256 MiB, device memory taken on first use) is
  split into slots of at most ``LOAD_SLOT_BYTES`` (16 MiB; at least four slots) used in turn; backups
  use ``backup_slots`` slots (16 with lanes, else 4) of at most ``BACKUP_SLOT_BYTES`` (8 MiB), which stay
  in L2 between gather and DMA.
  The per-slot kernels go on ``stage_lanes`` streams (slot ``s`` on lane ``s % lanes``), so that beside
  compute that holds every SM each landed slot's kernel is already queued when SMs free up; the stage
  stream orders transfers (a load joins its lanes there, where its per-layer events are recorded).
  Lanes need hardware queues of their own (``STAGE_LANES``): by default there are 8 lanes where
  ``CUDA_DEVICE_MAX_CONNECTIONS`` is at least 32, else one. Backups gather on at most
  ``BACKUP_LANES`` (4) of them, get ``WIDE_BACKUP_SLOTS`` slots with lanes (``backup_slots``) to cover
  a long compute kernel's worth of DMA, and spread their chunks' DMAs over the ``backup_streams``
  streams, as copy-engine backups do; a load's chunk DMAs go over ``load_streams`` streams (default 1).
  Each stream's queue on the device holds only so many copies before the call that adds one waits for
  the device to drain it: spreading raises how much a transfer can queue without blocking the host.
  On a block-first or layer-first pool the staging is lc-major instead: one DMA copy per (layer, K/V,
  run of consecutive host pages), loads one layer per unit, never staggered, a layer-wise load
  scattered on one lane unless ``stage_lanes`` is set, a whole load on every lane
  (:func:`~hicache.transfer.staged_plan.plan_group_lc`). A block-first pool's
  slots mirror its blocks by default (``block_staging: mirror``,
  :func:`~hicache.transfer.staged_plan_blocks.plan_group_blocks`): a block the transfer covers is one copy, the runs
  of partial blocks are packed into the slot, and the kernels find each page in the slot through slot
  keys uploaded with the indices. Kernels and planners
  address host pages by ``HostPool.host_keys``, which covers every layout with a page and a slot stride.
  See :mod:`hicache.transfer.staged_plan`, and :mod:`hicache.transfer.cuda_tuning` for the defaults and what
  they were measured to do. ``load_head_layers`` (default 0) has the gather kernel (``head_blocks``
  blocks, default 16) copy a staged load's first layers from host memory, one event each, before the
  DMA of the others starts, so compute can start sooner: it pays where compute is well over the load.
  ``staged_kernel`` picks how the device-side copies run:
  ``per_chunk`` (default) launches one short kernel per staging chunk; each launch must win SMs from
  running compute. ``resident`` launches one kernel per transfer that stays on ``resident_blocks`` SMs
  (default 2) and follows the DMA through 32-bit flags in device memory: the copy-engine stream writes
  a slot's flag after its DMA (``cuStreamWriteValue32``) and waits for the kernel's before reusing the
  slot (``cuStreamWaitValue32``); the kernel publishes per-layer flags that ``wait_layer`` waits on.
  Beside long compute kernels its rates vary less (H200, 4 KiB pieces beside a bf16 8192^3 GEMM: loads
  0.87-0.92 of a contiguous copy, against 0.77-0.94 per chunk), but the SMs it holds slow compute that
  runs beside it (32-layer overlap: 1.21-1.30x against 1.16-1.19x), so it is not the default.
* Deferred submission (``submit_ahead``, default ``DEFAULT_SUBMIT_AHEAD``): a layer-wise staged load
  submits in ``load`` only the units up to layer ``submit_ahead``; ``wait_layer(i)`` submits those up to
  layer ``i + submit_ahead`` before it makes the stream wait, ``wait``, ``done`` and
  :meth:`CudaHandle.submit` the rest; any new transfer, :meth:`CudaTransferEngine.synchronize` and
  ``close`` first submit everything pending, in submission order (:mod:`hicache.transfer.deferred`). The
  host's submission (milliseconds for many small pieces) then overlaps the copies and the compute instead
  of delaying layer 0. A caller that waits only through a device-wide synchronisation calls ``submit()``
  first.
* ``auto``: per transfer, the copy engine when its copies average at least ``ce_min_copy_bytes``
  (default 64 KiB: measured on H200/PCIe Gen5, the copy engine then runs at the link ceiling with
  no SM use, and its per-copy submission cost stays below the copy time); else the staged path where
  the host pool is page-first, or where its pages' runs of consecutive host pages average at least
  ``ce_min_copy_bytes // 2`` (layer-first and block-first pools); else the kernel.

Host memory: the host pool's buffer is used in place. When it is not already pinned (e.g. a
``HostPool(..., pin_memory=False)`` of tens of GB, which avoids the caching pinned allocator's
power-of-two rounding) the engine page-locks it with ``cudaHostRegister`` -- no second copy -- and
unregisters it in :meth:`CudaTransferEngine.close`. Close the engine before ``host_pool.release()``.

Where the engine lives: this module holds the engine, its options and the kernel and copy-engine
paths; :mod:`~hicache.transfer.cuda_staged_path` submits staged transfers and
:mod:`~hicache.transfer.cuda_resident_path` the resident kernel's (both mixins of the engine);
:mod:`~hicache.transfer.cuda_handle` has the handles. Below them: :mod:`~hicache.transfer.staged_plan`
(planning), :mod:`~hicache.transfer.cuda_streams` (slots, lanes, DMA streams),
:mod:`~hicache.transfer.cuda_kernels` (the CUDA sources through CuPy),
:mod:`~hicache.transfer.copy_engine` (batched copies) and :mod:`~hicache.transfer.cuda_tuning` (defaults).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from hicache.config import BLOCK_STAGINGS, LAYER_SIGNALS, STAGED_KERNELS
from hicache.pool import DevicePool, HostPool
from hicache.transfer.base import TransferEngine, TransferHandle, register_engine, sorted_unique
from hicache.transfer.copy_engine import CopyPlan, CudaRuntime, plan_copies
from hicache.transfer.cuda_driver import StreamWaiter
from hicache.transfer.cuda_handle import CudaHandle, LayerFlags
from hicache.transfer.cuda_kernels import (
    DEFAULT_BACKUP_BLOCKS,
    DEFAULT_LOAD_BLOCKS,
    DEFAULT_RESIDENT_BLOCKS,
    DEFAULT_STAGE_BLOCKS,
    DEFAULT_THREADS,
    CopyGeometry,
    KernelCopier,
)
from hicache.transfer.cuda_staged_path import StagedPath
from hicache.transfer.cuda_streams import DmaStreams, Stager
from hicache.transfer.cuda_tuning import (
    DEFAULT_BACKUP_STREAMS,
    DEFAULT_HEAD_BLOCKS,
    DEFAULT_LOAD_HEAD_LAYERS,
    DEFAULT_LOAD_STREAMS,
    DEFAULT_STAGING_BYTES,
    DEFAULT_SUBMIT_AHEAD,
    FAN_MIN_COPIES,
    STAGE_SLOTS,
    WIDE_BACKUP_SLOTS,
    default_stage_lanes,
)
from hicache.transfer.deferred import Pending, SubmitQueue
from hicache.transfer.staged_plan import group_layers

IoBackend = Literal["kernel", "copy_engine", "staged", "auto"]
IO_BACKENDS = ("kernel", "copy_engine", "staged", "auto")
CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_MAPPED = 2


@dataclass
class _InFlight:
    event: torch.cuda.Event
    host_pages: np.ndarray  # sorted, unique
    dev_pages: np.ndarray  # sorted, unique
    backup: bool
    keep: tuple[Any, ...] = ()  # buffers the device reads until ``event`` (host index arrays, by kernel)


@register_engine("cuda")
class CudaTransferEngine(StagedPath, TransferEngine):
    name = "cuda"
    sort_by_host = True  # every path walks host memory in address order (see _submit)

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, io_backend: str = "auto",
                 blocks: int | None = None, threads: int = DEFAULT_THREADS,
                 ce_min_copy_bytes: int = 64 << 10, register_host: bool = True,
                 layer_signal: str = "auto", staging_bytes: int = DEFAULT_STAGING_BYTES,
                 stagger_ways: int = 4, backup_streams: int = DEFAULT_BACKUP_STREAMS,
                 staged_kernel: str = "per_chunk", resident_blocks: int = DEFAULT_RESIDENT_BLOCKS,
                 stage_lanes: int | None = None, backup_slots: int | None = None,
                 load_streams: int = DEFAULT_LOAD_STREAMS, stage_blocks: int = DEFAULT_STAGE_BLOCKS,
                 load_head_layers: int = DEFAULT_LOAD_HEAD_LAYERS, head_blocks: int = DEFAULT_HEAD_BLOCKS,
                 block_staging: str = "mirror", submit_ahead: int = DEFAULT_SUBMIT_AHEAD) -> None:
        super().__init__(device_pool, host_pool)
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"io_backend: must be one of {IO_BACKENDS}, got {io_backend!r}")
        if device_pool.device.type != "cuda":
            raise ValueError(f"transfer engine 'cuda': the device pool is on {device_pool.device}, not a GPU")
        try:
            import cupy
        except ImportError as e:
            raise ValueError(f"transfer engine 'cuda' needs CuPy: {e}") from e
        # not page-first: one (layer, K/V) of consecutive pages is contiguous, so stage lc-major
        self.lc_major = host_pool.host_layout != "page_first"
        if block_staging not in BLOCK_STAGINGS:
            raise ValueError(f"block_staging: must be one of {BLOCK_STAGINGS}, got {block_staging!r}")
        # block-first: slots mirror the pool's blocks, so a block the transfer covers is one copy
        self.block_mirror = (host_pool.host_layout == "block_first" and host_pool.block_pages > 1
                             and block_staging == "mirror")
        if staged_kernel == "resident" and self.lc_major:
            raise ValueError("staged_kernel 'resident' needs a page_first host pool")
        if staging_bytes < STAGE_SLOTS:
            raise ValueError(f"staging_bytes: must be >= {STAGE_SLOTS}, got {staging_bytes}")
        if stagger_ways < 1:
            raise ValueError(f"stagger_ways: must be >= 1, got {stagger_ways}")
        if backup_streams < 1:
            raise ValueError(f"backup_streams: must be >= 1, got {backup_streams}")
        if load_streams < 1:
            raise ValueError(f"load_streams: must be >= 1, got {load_streams}")
        if stage_blocks < 1:
            raise ValueError(f"stage_blocks: must be >= 1, got {stage_blocks}")
        if load_head_layers < 0:
            raise ValueError(f"load_head_layers: must be >= 0, got {load_head_layers}")
        self.load_head_layers = load_head_layers
        if submit_ahead < 0:
            raise ValueError(f"submit_ahead: must be >= 0, got {submit_ahead}")
        self.submit_ahead = submit_ahead
        if head_blocks < 1:
            raise ValueError(f"head_blocks: must be >= 1, got {head_blocks}")
        self.head_blocks = head_blocks
        self._head: tuple[torch.cuda.Stream, KernelCopier] | None = None  # made on first use
        self.stage_blocks = stage_blocks
        if staged_kernel not in STAGED_KERNELS:
            raise ValueError(f"staged_kernel: must be one of {STAGED_KERNELS}, got {staged_kernel!r}")
        if resident_blocks < 1:
            raise ValueError(f"resident_blocks: must be >= 1, got {resident_blocks}")
        # Layer-wise lc-major loads (a pool that is not page-first) scatter on one lane unless told
        # otherwise: a layer is one or two chunks, one lane keeps up, and more lanes take SMs from the
        # per-layer compute beside them (H200, 32-layer overlap of 4 KiB pieces: 1.04 / 1.09 / 1.05x of
        # max(load, compute) on one lane, 1.04 / 1.19 / 1.27x on 8). Whole loads (``layer_wise=False``)
        # have no layer order to keep and scatter on every lane: beside long kernels that hold every SM,
        # one lane scatters a slot per kernel (H200, block-first 4 KiB loads beside GEMMs: 33 GB/s on one
        # lane, 43 on 2-8).
        lc_major_one_lane = stage_lanes is None and self.lc_major
        if stage_lanes is None:
            stage_lanes = default_stage_lanes()
        if stage_lanes < 1:
            raise ValueError(f"stage_lanes: must be >= 1, got {stage_lanes}")
        self.stage_lanes = stage_lanes
        self.load_lanes: int = 1 if lc_major_one_lane else stage_lanes
        if backup_slots is None:
            backup_slots = min(WIDE_BACKUP_SLOTS if stage_lanes > 1 else STAGE_SLOTS, staging_bytes)
        if backup_slots < STAGE_SLOTS or staging_bytes < backup_slots:
            raise ValueError(f"backup_slots: must be >= {STAGE_SLOTS} and <= staging_bytes, got {backup_slots}")
        self.backup_slots = backup_slots
        self.staged_kernel = staged_kernel
        self.resident_blocks = resident_blocks
        self.stagger_ways = stagger_ways
        self.backup_streams = backup_streams
        self.load_streams = load_streams
        self.io_backend: IoBackend = io_backend  # type: ignore[assignment]
        self.staging_bytes = staging_bytes
        self.ce_min_copy_bytes = ce_min_copy_bytes
        dev = device_pool.device
        self.device = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        self.device_index = int(self.device.index or 0)
        layout = self.layout
        L, C = layout.num_layers, layout.kv_count
        for layer in range(L):
            for c in range(C):
                t = device_pool.kv[layer][c]
                if not t.is_contiguous() or t.device != self.device:
                    raise ValueError(f"device pool kv[{layer}][{c}] must be contiguous on {self.device}")
        buf = host_pool.buffer
        if not buf.is_contiguous():
            raise ValueError("host pool buffer must be contiguous")
        self._registered_ptr: int | None = None
        if not host_pool.pinned:
            if not register_host:
                raise ValueError("host pool is not pinned; pass register_host=True or pin it")
            self._register(buf.data_ptr(), buf.numel() * buf.element_size())
        if layer_signal not in LAYER_SIGNALS:
            raise ValueError(f"layer_signal: must be one of {LAYER_SIGNALS}, got {layer_signal!r}")
        try:
            self._setup(cupy, buf, io_backend, blocks, threads)
            self._setup_flags(layer_signal)
            if staged_kernel == "resident":
                self._setup_mem_ops()
        except BaseException:
            self._unregister()
            raise
        # the end of the last staged load, which the load stream has not waited for (see _staged_load)
        self._unjoined: torch.cuda.Event | None = None
        self._closed = False

    def _setup(self, cupy: Any, buf: torch.Tensor, io_backend: str, blocks: int | None, threads: int) -> None:
        layout, host_pool, device_pool = self.layout, self.host_pool, self.device_pool
        L, C = layout.num_layers, layout.kv_count
        piece = layout.bytes_per_layer_piece
        try:
            host_base = int(cupy.cuda.runtime.hostGetDevicePointer(buf.data_ptr(), 0))
        except Exception:  # no such call in this CuPy, or memory not mapped
            host_base = buf.data_ptr()  # unified addressing: the host address is the device address
        ps, lcs = host_pool.piece_strides  # host keys (HostPool.host_keys) address pages
        hps, hlcs = ps * piece, lcs * piece
        self.geometry = CopyGeometry(
            dev_ptrs=tuple(device_pool.kv[layer][c].data_ptr() for layer in range(L) for c in range(C)),
            host_base=host_base, host_page_stride=hps, host_lc_stride=hlcs, piece_bytes=piece, num_lc=L * C,
        )
        self._dev_ptrs_np = np.array(self.geometry.dev_ptrs, dtype=np.uint64)
        self.kernel = KernelCopier(self.geometry, self.device_index, blocks or DEFAULT_LOAD_BLOCKS, threads)
        self.backup_kernel = KernelCopier(self.geometry, self.device_index, blocks or DEFAULT_BACKUP_BLOCKS,
                                          threads)
        self.stage_kernel = KernelCopier(self.geometry, self.device_index, self.stage_blocks, threads)
        self._rt: CudaRuntime | None = None
        if io_backend != "kernel":
            self._rt = CudaRuntime.get()
        self._stagers: dict[bool, Stager] = {}  # per direction (to_host), created on first use
        _, slot = self._slots(False)
        self.can_stage = self._rt is not None and group_layers(L, C, piece, 1, slot) > 0
        if io_backend == "staged" and not self.can_stage:
            raise ValueError(f"io_backend 'staged': one layer of a page ({C * piece} bytes) does not fit a "
                             f"staging slot of {slot} bytes")
        # high priority: a copy kernel waiting for SMs gets the next ones compute frees
        self.load_stream = torch.cuda.Stream(self.device, priority=-1)
        self.backup_stream = torch.cuda.Stream(self.device, priority=-1)
        # copy-engine backups fan out over these too (see DEFAULT_BACKUP_STREAMS)
        self._backup_lanes = [torch.cuda.Stream(self.device, priority=-1) for _ in range(self.backup_streams - 1)]
        # a staged load's chunk DMAs go over these too (load_streams; loads and backups never share one)
        self._load_lanes = [torch.cuda.Stream(self.device, priority=-1) for _ in range(self.load_streams - 1)]
        self._lock = threading.Lock()
        self._inflight: list[_InFlight] = []
        self._deferred = SubmitQueue()  # layer-wise loads' steps not yet submitted (hicache.transfer.deferred)

    def _setup_flags(self, layer_signal: str) -> None:
        """Kernel loads as one launch with per-layer flags when stream memory waits work here."""
        L = self.layout.num_layers
        self._flags = torch.zeros(L + 1, dtype=torch.int32, device=self.device)  # last word: self-test
        self._counters = torch.zeros(L, dtype=torch.int32, device=self.device)
        self._seq = 0
        self._waiter: StreamWaiter | None = None
        self._context = 0
        self.layer_signal = "events"
        if layer_signal == "events":
            return
        try:
            waiter = StreamWaiter.get()
            self._flags[L].fill_(1)
            torch.cuda.synchronize(self.device)
            probe = torch.cuda.Stream(self.device)
            waiter.wait_geq(probe.cuda_stream, self._flags.data_ptr() + 4 * L, 1, 0)
            probe.synchronize()
            self._context = waiter.current_context()
        except (OSError, RuntimeError) as e:
            if layer_signal == "flags":
                raise ValueError(f"layer_signal='flags': stream memory waits unavailable: {e}") from e
            return
        self._waiter = waiter
        self.layer_signal = "flags"

    def _next_seq(self) -> int:
        self._seq += 1
        if self._seq >= 1 << 31:  # wrap: start over from zeroed flags once every queued wait has passed
            torch.cuda.synchronize(self.device)
            self._flags.zero_()
            torch.cuda.synchronize(self.device)
            self._seq = 1
        return self._seq

    # ------------------------------------------------------------------ host memory
    def _register(self, ptr: int, nbytes: int) -> None:
        import cupy

        with cupy.cuda.Device(self.device_index):
            cupy.cuda.runtime.hostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED)
        self._registered_ptr = ptr

    @property
    def registered_host(self) -> bool:
        """True when this engine page-locked the host pool itself (and unpins it on close)."""
        return self._registered_ptr is not None

    # ------------------------------------------------------------------ planning
    def plan(self, dev_idx: np.ndarray, host_idx: np.ndarray, lc_begin: int, n_lc: int, to_host: bool) -> CopyPlan:
        g = self.geometry
        return plan_copies(self._dev_ptrs_np, g.host_base, g.host_page_stride, g.host_lc_stride, g.piece_bytes,
                           dev_idx, self.host_pool.host_keys(host_idx), lc_begin, n_lc, to_host)

    def choose_backend(self, dev_idx: np.ndarray, host_idx: np.ndarray) -> str:
        """``kernel``, ``copy_engine`` or ``staged`` for this transfer under the configured ``io_backend``."""
        if self.io_backend != "auto":
            return self.io_backend
        if self._rt is None or len(dev_idx) == 0:
            return "kernel"
        plan = self.plan(dev_idx, host_idx, 0, 1, False)
        if plan.nbytes / plan.n_copies >= self.ce_min_copy_bytes:
            return "copy_engine"
        if not self.can_stage:
            return "kernel"
        if self.lc_major:  # staged copies are runs of consecutive host pages: only long runs pay
            return "staged" if self.mean_host_run_bytes(host_idx) >= self.ce_min_copy_bytes // 2 else "kernel"
        return "staged"

    def mean_host_run_bytes(self, host_idx: np.ndarray) -> float:
        """Mean size of one (layer, K/V)'s run of pages that are contiguous in host memory: what an
        lc-major staged copy moves. ``auto`` stages an lc-major transfer when this reaches half of
        ``ce_min_copy_bytes`` (a block of 16 pages of 4 KiB pieces makes 64 KiB); shorter runs go
        through the gather kernel, whose rate does not depend on them."""
        keys = np.sort(self.host_pool.host_keys(host_idx))
        if len(keys) == 0:
            return 0.0
        runs = 1 + int(np.count_nonzero(np.diff(keys) != 1))
        return len(keys) * self.geometry.piece_bytes / runs

    # ------------------------------------------------------------------ submission
    def _hazards(self, host_pages: np.ndarray, dev_pages: np.ndarray, backup: bool) -> list[torch.cuda.Event]:
        """Events of in-flight transfers on the other stream that touch the same pages."""
        waits = []
        alive = []
        for op in self._inflight:
            if op.event.query():
                continue
            alive.append(op)
            if op.backup == backup:
                continue  # same stream: already ordered
            if (np.intersect1d(op.host_pages, host_pages, assume_unique=True).size
                    or np.intersect1d(op.dev_pages, dev_pages, assume_unique=True).size):
                waits.append(op.event)
        self._inflight = alive
        return waits

    def _submit(self, dev_idx: np.ndarray, host_idx: np.ndarray, to_host: bool,
                layer_wise: bool = True) -> CudaHandle:
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        L, C = self.layout.num_layers, self.layout.kv_count
        n = len(dev_idx)
        if n == 0:
            return CudaHandle(L, 0, [], "none", self.device)
        backend = self.choose_backend(dev_idx, host_idx)
        if self.sort_by_host:
            # Any order of the pairs moves the same bytes; host memory written in address order is faster
            # over PCIe (H200, staged backups: 0.88 -> 0.93 of the ceiling at 4 KiB pieces, 0.93 -> 0.96
            # at 16 KiB; loads and the other paths within 1-2%, either way).
            order = np.argsort(host_idx, kind="stable")
            dev_idx, host_idx = np.asarray(dev_idx)[order], np.asarray(host_idx)[order]
        stream = self.backup_stream if to_host else self.load_stream
        host_pages = sorted_unique(host_idx)
        dev_pages = sorted_unique(dev_idx)
        with self._lock, torch.cuda.device(self.device):
            # earlier loads' deferred steps first: hazards, slots and ``_unjoined`` then know all of them
            self._deferred.run_all()
            compute = torch.cuda.current_stream(self.device)
            ready = torch.cuda.Event()
            ready.record(compute)
            waits = self._hazards(host_pages, dev_pages, to_host)
            stream.wait_event(ready)
            for ev in waits:
                stream.wait_event(ev)
            if (not to_host and self._unjoined is not None
                    and not (backend == "staged" and self.staged_kernel != "resident")):
                stream.wait_event(self._unjoined)  # after the scatters of the staged loads before it
                self._unjoined = None
            keep: tuple[Any, ...] = ()
            if backend == "staged":
                staged_events, keep, sflags, deferral = self._staged(dev_idx, host_idx, to_host, stream,
                                                                     [ready, *waits], layer_wise)
                self._inflight.append(_InFlight(staged_events[-1], host_pages, dev_pages, to_host, keep))
                return CudaHandle(L, n, staged_events, backend, self.device, keep, sflags, deferral)
            if backend == "kernel":
                idx_host = torch.from_numpy(np.stack([dev_idx, self.host_pool.host_keys(host_idx)])).pin_memory()
                with torch.cuda.stream(stream):  # allocated on the stream that uses it
                    idx = torch.empty(idx_host.shape, dtype=torch.int64, device=self.device)
                kern = self.backup_kernel if to_host else self.kernel
                kern.fetch_indices(stream.cuda_stream, idx_host.data_ptr(), idx.data_ptr(), idx.numel())
                keep = (idx_host, idx)
                dptr = idx.data_ptr()
                hptr = dptr + n * 8
            events: list[torch.cuda.Event] = []
            flags: LayerFlags | None = None
            sh = stream.cuda_stream
            if to_host:
                # one launch (or one batch) for every layer; every layer is ready when it completes
                if backend == "kernel":
                    self.backup_kernel.launch(sh, dptr, hptr, n, 0, L * C, to_host=True)
                else:
                    self._run_fanned(self.plan(dev_idx, host_idx, 0, L * C, True), stream)
                ev = torch.cuda.Event()
                ev.record(stream)
                events = [ev] * L
            elif backend == "kernel" and self._waiter is not None:
                # one launch for every layer; the kernel publishes each layer's flag
                seq = self._next_seq()
                self.kernel.launch_load_layers(sh, dptr, hptr, n, L, C, self._counters.data_ptr(),
                                               self._flags.data_ptr(), seq)
                ev = torch.cuda.Event()
                ev.record(stream)
                events = [ev] * L
                flags = LayerFlags(self._waiter, self._flags.data_ptr(), seq, self._context)
            else:
                plan = self.plan(dev_idx, host_idx, 0, L * C, False) if backend != "kernel" else None
                per_layer = plan.n_copies // L if plan is not None else 0  # the plan is slot-major
                for layer in range(L):
                    if plan is None:
                        self.kernel.launch(sh, dptr, hptr, n, layer * C, C, to_host=False)
                    else:
                        assert self._rt is not None
                        lo, hi = layer * per_layer, (layer + 1) * per_layer
                        self._rt.run(CopyPlan(plan.dst[lo:hi], plan.src[lo:hi], plan.size[lo:hi]), sh)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events.append(ev)
            self._inflight.append(_InFlight(events[-1], host_pages, dev_pages, to_host, keep))
        return CudaHandle(L, n, events, backend, self.device, keep, flags)

    def _run_fanned(self, plan: CopyPlan, stream: torch.cuda.Stream) -> None:
        """Issue a copy-engine plan split into contiguous parts over ``stream`` and the backup lanes.

        Every part starts after the work queued on ``stream`` so far, and ``stream`` waits for every part,
        so the transfer is ordered on ``stream`` exactly as one batch would be. Parts have at least
        ``FAN_MIN_COPIES`` copies.
        """
        assert self._rt is not None
        parts = max(1, min(1 + len(self._backup_lanes), plan.n_copies // FAN_MIN_COPIES))
        dma = DmaStreams(stream, self._backup_lanes[:parts - 1])
        n = plan.n_copies
        for i in range(parts):
            lo, hi = i * n // parts, (i + 1) * n // parts
            self._rt.run(CopyPlan(plan.dst[lo:hi], plan.src[lo:hi], plan.size[lo:hi]), dma.stream(i).cuda_stream)
        dma.join()

    def _advance(self, pending: Pending, steps: int) -> None:
        """Submit deferred steps: every earlier transfer's, then ``pending``'s until ``steps`` of it ran
        (see :class:`~hicache.transfer.deferred.SubmitQueue`). Raises that transfer's error, if any."""
        with self._lock, torch.cuda.device(self.device):
            self._deferred.advance(pending, steps)

    def submit_pending(self) -> None:
        """Submit every deferred step of every transfer (never waits for the device)."""
        with self._lock, torch.cuda.device(self.device):
            self._deferred.run_all()

    def load(self, host_idx: np.ndarray, device_idx: np.ndarray, layer_wise: bool = True) -> TransferHandle:
        """See :meth:`TransferEngine.load`. A staged load that is not ``layer_wise`` is never staggered and
        has no head: on a page-first pool it moves whole pages where one fits a slot (one layer group), at
        the copy engine's full rate (H200, 32-layer loads of 4-16 KiB pieces: 0.99 of the link, against
        0.89-0.95 in staggered layer groups); on other pools as many layers per group as let every page
        share a slot."""
        src, dst = self._check(host_idx, device_idx, self.host_pool.num_pages, self.device_pool.num_pages)
        return self._submit(dst, src, to_host=False, layer_wise=layer_wise)

    def backup(self, device_idx: np.ndarray, host_idx: np.ndarray) -> TransferHandle:
        src, dst = self._check(device_idx, host_idx, self.device_pool.num_pages, self.host_pool.num_pages)
        return self._submit(src, dst, to_host=True)

    def synchronize(self) -> None:
        """Block until every transfer has finished, deferred steps submitted first."""
        self.submit_pending()
        self.load_stream.synchronize()
        self.backup_stream.synchronize()
        for st in self._stagers.values():
            st.synchronize()

    def close(self) -> None:
        """Finish in-flight copies, then unpin the host pool if this engine pinned it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.synchronize()
        self._inflight = []
        self._stagers.clear()
        self._unregister()

    def _unregister(self) -> None:
        if self._registered_ptr is not None:
            import cupy

            with cupy.cuda.Device(self.device_index):
                cupy.cuda.runtime.hostUnregister(self._registered_ptr)
            self._registered_ptr = None
