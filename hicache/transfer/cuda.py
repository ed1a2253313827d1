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
  layers become ready about ``ways`` times as often (:func:`~hicache.transfer.staged.stagger_schedule`).
  ``staging_bytes`` (default ``DEFAULT_STAGING_BYTES``, 256 MiB, device memory taken on first use) is
  split into slots of at most ``LOAD_SLOT_BYTES`` (16 MiB; at least four slots) used in turn; backups
  use four slots of at most ``BACKUP_SLOT_BYTES`` (8 MiB), which stay in L2 between gather and DMA.
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
  (:func:`~hicache.transfer.staged.plan_group_lc`). A block-first pool's
  slots mirror its blocks by default (``block_staging: mirror``,
  :func:`~hicache.transfer.staged.plan_group_blocks`): a block the transfer covers is one copy, the runs
  of partial blocks are packed into the slot, and the kernels find each page in the slot through slot
  keys uploaded with the indices. Kernels and planners
  address host pages by ``HostPool.host_keys``, which covers every layout with a page and a slot stride.
  See :mod:`hicache.transfer.staged`, and :mod:`hicache.transfer.cuda_tuning` for the defaults and what
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
  the host pool is page-first; else the kernel.

Host memory: the host pool's buffer is used in place. When it is not already pinned (e.g. a
``HostPool(..., pin_memory=False)`` of tens of GB, which avoids the caching pinned allocator's
power-of-two rounding) the engine page-locks it with ``cudaHostRegister`` -- no second copy -- and
unregisters it in :meth:`CudaTransferEngine.close`. Close the engine before ``host_pool.release()``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from hicache.config import BLOCK_STAGINGS, LAYER_SIGNALS, STAGED_KERNELS
from hicache.pool import DevicePool, HostPool
from hicache.transfer.base import TransferEngine, TransferHandle, register_engine, sorted_unique
from hicache.transfer.copy_engine import CopyPlan, CudaRuntime, plan_copies
from hicache.transfer.cuda_driver import StreamWaiter
from hicache.transfer.cuda_kernels import (
    DEFAULT_BACKUP_BLOCKS,
    DEFAULT_LOAD_BLOCKS,
    DEFAULT_RESIDENT_BLOCKS,
    DEFAULT_STAGE_BLOCKS,
    DEFAULT_THREADS,
    STAGED_DESC_WORDS,
    CopyGeometry,
    KernelCopier,
)
from hicache.transfer.cuda_streams import DmaStreams, Stager
from hicache.transfer.cuda_tuning import (
    BACKUP_LANES,
    DEFAULT_BACKUP_STREAMS,
    DEFAULT_HEAD_BLOCKS,
    DEFAULT_LOAD_HEAD_LAYERS,
    DEFAULT_LOAD_STREAMS,
    DEFAULT_STAGING_BYTES,
    DEFAULT_SUBMIT_AHEAD,
    FAN_MIN_COPIES,
    SEQ_LIMIT,
    STAGE_RAMP,
    STAGE_SLOTS,
    STAGGER_MIN_PAGES,
    WIDE_BACKUP_SLOTS,
    default_stage_lanes,
    staging_slots,
)
from hicache.transfer.deferred import Pending, SubmitQueue
from hicache.transfer.resident import ResidentChunk, number_chunks
from hicache.transfer.staged import (
    LoadSchedule,
    StagedChunk,
    StaggerUnit,
    group_layers,
    load_schedule,
    plan_group,
    plan_group_blocks,
    plan_group_lc,
    shift_layers,
    with_slot_base,
)

IoBackend = Literal["kernel", "copy_engine", "staged", "auto"]
IO_BACKENDS = ("kernel", "copy_engine", "staged", "auto")
CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_MAPPED = 2
@dataclass(frozen=True)
class LayerFlags:
    """Per-layer readiness published by a single-launch load: ``flags[layer] >= seq`` once it landed."""

    waiter: StreamWaiter
    flags_ptr: int  # device address of uint32 flags, one per layer
    seq: int
    context: int  # CUcontext to make current on threads that have none


class CudaHandle(TransferHandle):
    """Per-layer readiness of one transfer (CUDA events, or layer flags plus a completion event).

    Keeps the index tensors alive until it completes. A layer-wise staged load may have steps not yet
    submitted (``pending``, see :mod:`hicache.transfer.deferred`): ``wait_layer(i)`` first submits those
    up to layer ``i + ahead``, ``wait``, ``done`` and :meth:`submit` all of them.
    """

    def __init__(self, num_layers: int, num_pages: int, events: list[torch.cuda.Event],
                 backend: str, device: torch.device, keep: tuple[Any, ...] = (),
                 flags: LayerFlags | None = None, pending: _Deferral | None = None) -> None:
        self.num_layers = num_layers
        self.device = device
        self.num_pages = num_pages
        self.events = events  # one per layer, or empty when nothing was copied
        self.backend = backend
        self.flags = flags
        self._keep: tuple[Any, ...] = keep
        self._pending = pending

    def _submit_through(self, layer: int) -> None:
        """Submit the steps layer ``layer`` (and ``ahead`` more) needs; raise if one of them failed."""
        d = self._pending
        if d is None:
            return
        d.advance(layer)
        if d.pending.complete:
            self._pending = None

    @property
    def unsubmitted_steps(self) -> int:
        """Steps of this transfer the host has not submitted yet (0 once all are queued on the device)."""
        d = self._pending
        return 0 if d is None else d.pending.total - d.pending.ran

    def submit(self) -> None:
        """Submit every step not yet submitted (never waits for the device). Afterwards the transfer is
        ordered on the engine's streams as if ``load`` had submitted it all: e.g. a device-wide
        synchronisation then covers it."""
        self._submit_through(self.num_layers - 1)

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"wait_layer: layer {layer} outside [0, {self.num_layers})")
        self._submit_through(layer)
        if not self.events or self.events[layer].query():
            return  # nothing copied, or already landed: no wait needed
        stream = torch.cuda.current_stream(self.device)
        f = self.flags
        if f is not None:
            f.waiter.wait_geq(stream.cuda_stream, f.flags_ptr + 4 * layer, f.seq, f.context)
        else:
            stream.wait_event(self.events[layer])

    def wait(self) -> None:
        self.submit()
        if self.events:
            self.events[-1].synchronize()
        self._keep = ()

    def done(self) -> bool:
        self.submit()
        if not self.events or self.events[-1].query():
            self._keep = ()
            return True
        return False


@dataclass
class _Deferral:
    """A layer-wise staged load's steps not yet submitted, and which of them each layer needs."""

    engine: CudaTransferEngine
    pending: Pending
    steps_for_layer: list[int]  # steps that must have run before layer i is ready (non-decreasing)
    ahead: int  # layers submitted beyond the one asked for

    def advance(self, layer: int) -> None:
        want = self.steps_for_layer[min(layer + self.ahead, len(self.steps_for_layer) - 1)]
        if self.pending.ran < want or self.pending.error is not None:
            self.engine._advance(self.pending, want)


@dataclass
class _InFlight:
    event: torch.cuda.Event
    host_pages: np.ndarray  # sorted, unique
    dev_pages: np.ndarray  # sorted, unique
    backup: bool
    keep: tuple[Any, ...] = ()  # buffers the device reads until ``event`` (host index arrays, by kernel)


def _unit_ramps(sched: LoadSchedule) -> list[tuple[StaggerUnit, int]]:
    """A staged load's units in order, each with its chunks' ramp down (only the last unit's shrink)."""
    last = len(sched.units) - 1
    return [(u, STAGE_RAMP if ui == last else 0) for ui, u in enumerate(sched.units)]


@dataclass
class _StagePlans:
    """One staged transfer's host keys (host order) and the chunks planned for them, by group shape
    ``(layers, slot bytes, ramp up, ramp down)``: lc-major chunks planned on first use, block-mirrored
    ones before the index upload, with where their slot keys sit in the uploaded index array."""

    keys: np.ndarray
    memo: dict[tuple[int, int, int, int], list[StagedChunk]] = field(default_factory=dict)
    key_offset: dict[tuple[int, int, int, int], int] = field(default_factory=dict)


@register_engine("cuda")
class CudaTransferEngine(TransferEngine):
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

    def _setup_mem_ops(self) -> None:
        """Stream memory writes and waits, which the resident staged kernel needs: checked once here."""
        probe_buf = torch.zeros(1, dtype=torch.int32, device=self.device)
        try:
            waiter = StreamWaiter.get()
            torch.cuda.synchronize(self.device)
            probe = torch.cuda.Stream(self.device)
            waiter.write(probe.cuda_stream, probe_buf.data_ptr(), 3, 0)
            waiter.wait_geq(probe.cuda_stream, probe_buf.data_ptr(), 3, 0)
            probe.synchronize()
            context = waiter.current_context()
        except (OSError, RuntimeError) as e:
            raise ValueError(f"staged_kernel='resident': stream memory operations unavailable: {e}") from e
        if int(probe_buf.item()) != 3:
            raise ValueError("staged_kernel='resident': a stream memory write did not land")
        self._mem_ops = waiter
        self._mem_context = context

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

    def _slots(self, to_host: bool) -> tuple[int, int]:
        page = self.layout.num_layers * self.layout.kv_count * self.layout.bytes_per_layer_piece
        return staging_slots(self.staging_bytes, page, to_host, self.backup_slots)

    def _stager(self, to_host: bool) -> Stager:
        st = self._stagers.get(to_host)
        if st is None:
            n_slots, slot = self._slots(to_host)
            max_pages = slot // (self.layout.kv_count * self.layout.bytes_per_layer_piece)
            lanes = min(self.stage_lanes, BACKUP_LANES) if to_host else self.stage_lanes
            st = self._stagers[to_host] = Stager(self.device, n_slots, slot, max_pages, self.layout.num_layers,
                                                  lanes)
        return st

    def _staged(self, dev_idx: np.ndarray, host_idx: np.ndarray, to_host: bool, stream: torch.cuda.Stream,
                deps: list[torch.cuda.Event],
                layer_wise: bool = True) -> tuple[list[torch.cuda.Event], tuple[Any, ...], LayerFlags | None,
                                                  _Deferral | None]:
        """Submit a staged transfer (see :mod:`hicache.transfer.staged`); returns per-layer events, the
        buffers to keep alive, the layer flags of a resident load (:meth:`_staged_resident`), and the
        steps of a layer-wise load not submitted yet (:meth:`_staged_load`).

        Load (:meth:`_staged_load`), per chunk: the load stream DMAs host runs into a slot, the slot's
        lane scatters it into L1. Backup, per chunk: the slot's lane gathers L1 into it, the backup stream
        DMAs it out. A slot is refilled only after the previous user of it finished
        (events ``free``). A backup's last event is recorded on ``stream``, so later work on that stream
        is ordered after it; a load's on the stage stream, which the next staged load's scatters follow,
        and any other transfer on ``stream`` waits for it (:meth:`_staged_load`).
        """
        assert self._rt is not None
        L, C = self.layout.num_layers, self.layout.kv_count
        g = self.geometry
        piece = g.piece_bytes
        st = self._stager(to_host)
        sst = st.stream
        for ev in deps:
            sst.wait_event(ev)
        head = 0
        if not to_host and layer_wise and self.staged_kernel != "resident":
            head = self._head_layers(len(dev_idx), st)
        keys = self.host_pool.host_keys(host_idx)  # ascending, as host_idx
        # device pages; after them the host keys, which only the head's gather kernel reads
        both = np.concatenate([dev_idx, keys]) if head else dev_idx
        plans = _StagePlans(keys)
        sched = (None if to_host or self.staged_kernel == "resident"
                 else self._load_schedule(len(dev_idx), st, head, layer_wise))
        groups = self._backup_shapes(st) if to_host else []
        if self.block_mirror:  # block-first, so never the resident kernel (page-first only)
            # block-mirrored chunks carry slot keys the kernels read: plan every group shape now, and
            # upload the keys with the indices
            n = len(dev_idx)
            shapes = groups if sched is None else [(u.n_layers, 0, ramp) for u, ramp in _unit_ramps(sched[0])]
            parts = [both]
            offset = len(both)
            for n_layers, ramp_up, ramp_down in dict.fromkeys(shapes):
                chunks = plan_group_blocks(g.host_base, piece, C, L, self.host_pool.block_pages, host_idx, 0,
                                           n_layers, st.slot_bytes, to_host, ramp_up, ramp_down)
                if chunks is None:
                    continue  # a block of these layers outgrows a slot: lc-major chunks (planned on use)
                shape = (n_layers, st.slot_bytes, ramp_up, ramp_down)
                plans.memo[shape] = chunks
                plans.key_offset[shape] = offset
                parts.append(np.concatenate([ch.slot_keys for ch in chunks if ch.slot_keys is not None]))
                offset += n
            both = np.concatenate(parts)
        idx_host = torch.from_numpy(np.ascontiguousarray(both, dtype=np.int64)).pin_memory()
        with torch.cuda.stream(sst):  # allocated on the stream that uses it
            idx = torch.empty(idx_host.shape, dtype=torch.int64, device=self.device)
        # by a kernel, not a memcpy, which would queue behind bulk DMA in flight (see fetch_indices)
        self.stage_kernel.fetch_indices(sst.cuda_stream, idx_host.data_ptr(), idx.data_ptr(), idx.numel())
        if self.staged_kernel == "resident":
            events, meta, flags = self._staged_resident(keys, to_host, stream, st, idx.data_ptr(), layer_wise)
            return events, (idx_host, idx, *meta), flags, None
        if sched is not None:
            lanes = self.load_lanes if layer_wise else self.stage_lanes
            events, deferral = self._staged_load(plans, sched, stream, st, idx.data_ptr(), head, lanes,
                                                 self.submit_ahead if layer_wise else L)
            return events, (idx_host, idx), None, deferral
        dma = self._dma_streams(stream)
        st.begin()
        k = 0
        l0 = 0
        for ng, ramp_up, _ in groups:
            for ch in self._plan_chunks(plans, l0, ng, st.slot_bytes, True, ramp_up, 0):
                s, base = st.take()
                plan = with_slot_base(ch.plan, base, True)
                lane = st.lane(s)
                prev = st.free[s]
                if prev is not None:
                    lane.wait_event(prev)
                self._launch_stage(lane, plans, idx.data_ptr(), ch, (ng, st.slot_bytes, ramp_up, 0), l0, ng, True,
                                   base, st)
                done = torch.cuda.Event()
                done.record(lane)
                out = dma.stream(k)
                k += 1
                out.wait_event(done)
                self._rt.run(plan, out.cuda_stream)
                freed = torch.cuda.Event()
                freed.record(out)
                st.free[s] = freed
            l0 += ng
        dma.join()
        final = torch.cuda.Event()
        final.record(stream)
        return [final] * L, (idx_host, idx), None, None

    def _dma_streams(self, stream: torch.cuda.Stream, to_host: bool = True) -> DmaStreams:
        """The streams a staged transfer's chunk DMAs go on in turn: ``stream`` and the backup lanes
        (backups) or the load lanes (loads)."""
        return DmaStreams(stream, self._backup_lanes if to_host else self._load_lanes)

    def _backup_shapes(self, st: Stager) -> list[tuple[int, int, int]]:
        """A staged backup's layer groups in order, as (layers, ramp up, ramp down): whole pages where
        one fits a slot (block-mirrored slots: where one bin of the group's layers, a block's worth of
        pages, fits), the first group's chunks ramped up."""
        L, C = self.layout.num_layers, self.layout.kv_count
        unit = self.geometry.piece_bytes
        per_group = 0
        if self.block_mirror:  # else a deep model's block outgrows a slot and mirroring is never used
            b = unit * self.host_pool.block_pages
            per_group = group_layers(L, C, b, L * C * b, st.slot_bytes)
        if per_group == 0:
            per_group = group_layers(L, C, unit, L * C * unit, st.slot_bytes)
        return [(min(per_group, L - l0), STAGE_RAMP if l0 == 0 else 0, 0) for l0 in range(0, L, per_group)]

    def _plan_chunks(self, plans: _StagePlans, layer_begin: int, n_layers: int, slot_bytes: int, to_host: bool,
                     ramp_up: int, ramp_down: int, lo: int = 0, hi: int | None = None) -> list[StagedChunk]:
        """The staged chunks of one layer group for the transfer's pages ``[lo, hi)``: page-major
        (:func:`~hicache.transfer.staged.plan_group`) for a page-first pool, else block-mirrored where
        :meth:`_staged` planned them (:func:`~hicache.transfer.staged.plan_group_blocks`), else lc-major
        (:func:`~hicache.transfer.staged.plan_group_lc`). Lc-major and block-mirrored chunks (always of
        every page: such loads are never staggered) are planned once per group shape in ``plans`` and
        shifted to each layer group (:func:`~hicache.transfer.staged.shift_layers`)."""
        g, C = self.geometry, self.layout.kv_count
        keys = plans.keys[lo:hi]
        if self.lc_major:
            assert len(keys) == len(plans.keys), "lc-major transfers are not split into parts"
            shape = (n_layers, slot_bytes, ramp_up, ramp_down)
            memo = plans.memo
            base = memo.get(shape)
            if base is None:
                base = memo[shape] = plan_group_lc(g.host_base, g.host_page_stride, g.host_lc_stride,
                                                   g.piece_bytes, C, keys, 0, n_layers, slot_bytes, to_host,
                                                   ramp_up, ramp_down)
            return shift_layers(base, layer_begin, C, g.host_lc_stride, to_host)
        return plan_group(g.host_base, g.host_page_stride, g.piece_bytes, C, keys, layer_begin, n_layers,
                          slot_bytes, to_host, ramp_up, ramp_down)

    def _launch_stage(self, lane: torch.cuda.Stream, plans: _StagePlans, idx_ptr: int, ch: StagedChunk,
                      shape: tuple[int, int, int, int], layer_begin: int, n_layers: int, to_host: bool, base: int,
                      st: Stager, lo: int = 0) -> None:
        """The device-side copy of one staged chunk on ``lane``: L1 pages at ``idx_ptr`` (positions from
        ``lo + ch.i0``), the slot at ``base`` addressed by position (page-first and lc-major slots) or by
        the chunk's slot keys, uploaded after the indices (block-mirrored)."""
        C = self.layout.kv_count
        dev_ptr = idx_ptr + 8 * (lo + ch.i0)
        if ch.slot_keys is not None:
            pos_ptr = idx_ptr + 8 * (plans.key_offset[shape] + ch.i0)
            strides = (self.geometry.piece_bytes, self.host_pool.block_pages * self.geometry.piece_bytes)
            self.stage_kernel.launch_staged(lane.cuda_stream, dev_ptr, pos_ptr, ch.i1 - ch.i0, layer_begin * C,
                                            n_layers * C, to_host, base, strides=strides)
        else:
            self.stage_kernel.launch_staged(lane.cuda_stream, dev_ptr, st.pos.data_ptr(), ch.i1 - ch.i0,
                                            layer_begin * C, n_layers * C, to_host, base, self.lc_major)

    def _staged_load(self, plans: _StagePlans, schedule: tuple[LoadSchedule, list[tuple[int, int]]],
                     stream: torch.cuda.Stream, st: Stager, idx_ptr: int, head: int = 0,
                     lanes: int | None = None, ahead: int = 0,
                     ) -> tuple[list[torch.cuda.Event], _Deferral | None]:
        """The load half of :meth:`_staged`: groups of layers, staggered over parts of the page list
        (:func:`~hicache.transfer.staged.stagger_schedule`), scattered on the stager's first ``lanes``
        lanes (default all). Returns the per-layer events and, when some units are left to submit, their
        deferral.

        ``plans`` holds the host pages and keys (``HostPool.host_keys``) in host order and ``idx_ptr`` the
        matching device pages on the GPU (then, when ``head`` > 0, the host keys; then the slot keys of
        block-mirrored chunks). Each unit of the
        schedule is one part's pages for one group of layers (an lc-major pool: one layer of every page),
        moved slot by slot, each slot scattered on its lane; the stage stream then waits for the unit's
        scatters and records an event, and layer ``i``'s event is that of the unit after which every part
        holds it. The first ``head`` layers are not staged: the gather kernel copies
        them from host memory, one launch and one event per layer, on the head stream, before the DMA of
        the others (:meth:`_head_layers`).

        Units are submitted here only up to those that layer ``ahead`` needs (all of them when ``ahead`` is
        the last layer or beyond); the others are submitted in order by the handle's later calls
        (:class:`_Deferral`, :mod:`hicache.transfer.deferred`). Their events exist from the start and are
        recorded as their units are submitted.
        """
        assert self._rt is not None
        rt = self._rt
        L, C = self.layout.num_layers, self.layout.kv_count
        sst = st.stream
        head_events: list[torch.cuda.Event] = []
        if head:
            hs, kern = self._head_copier()
            fetched = torch.cuda.Event()
            fetched.record(sst)  # the transfer's dependencies and the index fetch
            hs.wait_event(fetched)
            n = len(plans.keys)
            for layer in range(head):
                kern.launch(hs.cuda_stream, idx_ptr, idx_ptr + 8 * n, n, layer * C, C, to_host=False)
                ev = torch.cuda.Event()
                ev.record(hs)
                head_events.append(ev)
            # the DMA of the other layers follows: beside it the kernel's reads get little of the link
            stream.wait_event(head_events[-1])
        sched, bounds = schedule
        dma = self._dma_streams(stream, to_host=False)
        st.begin()
        units = _unit_ramps(sched)
        last = len(units) - 1
        landed = [torch.cuda.Event() for _ in units]
        final = torch.cuda.Event()

        def steps() -> Generator[None, None, None]:
            k = 0
            for ui, (u, ramp_down) in enumerate(units):
                lo, hi = bounds[u.way]
                scattered: list[torch.cuda.Event] = []
                shape = (u.n_layers, st.slot_bytes, 0, ramp_down)
                for ch in self._plan_chunks(plans, u.layer_begin, u.n_layers, st.slot_bytes, False, 0, ramp_down,
                                            lo, hi):
                    s, base = st.take()
                    plan = with_slot_base(ch.plan, base, False)
                    out = dma.stream(k)
                    k += 1
                    prev = st.free[s]
                    if prev is not None:
                        out.wait_event(prev)
                    rt.run(plan, out.cuda_stream)
                    done = torch.cuda.Event()
                    done.record(out)
                    lane = st.lane(s, lanes)
                    lane.wait_event(done)
                    self._launch_stage(lane, plans, idx_ptr, ch, shape, u.layer_begin, u.n_layers, False, base, st,
                                       lo)
                    freed = torch.cuda.Event()
                    freed.record(lane)
                    st.free[s] = freed
                    scattered.append(freed)
                for freed in scattered:
                    sst.wait_event(freed)
                landed[ui].record(sst)  # this part's group is in L1
                if ui == last:
                    dma.join()
                    if head_events:
                        sst.wait_event(head_events[-1])
                    # The end of the load is on the stage stream, after every scatter (each follows its DMA)
                    # and the head. ``stream`` does not wait for it: the next staged load's DMAs only need
                    # free slots, and its scatters follow this load's on the stage stream. Waiting here left
                    # the link idle at the end of every load until its last scatter got SMs, up to a whole
                    # GEMM kernel beside compute. Any other transfer on ``stream`` waits for it first
                    # (``_unjoined``, in :meth:`_submit`).
                    final.record(sst)
                    self._unjoined = final
                yield

        events = head_events + [final if sched.ready[layer] == last else landed[sched.ready[layer]]
                                for layer in range(L - head)]
        # steps (units) each layer needs submitted: none for the head's, which are queued above
        need = [0] * head + [sched.ready[layer] + 1 for layer in range(L - head)]
        pending = Pending(steps(), len(units))
        self._deferred.add(pending)  # every earlier step ran (``_submit``): this runs only its own
        self._deferred.advance(pending, need[min(ahead, L - 1)])
        if pending.complete:
            return events, None
        return events, _Deferral(self, pending, need, ahead)

    def _advance(self, pending: Pending, steps: int) -> None:
        """Submit deferred steps: every earlier transfer's, then ``pending``'s until ``steps`` of it ran
        (see :class:`~hicache.transfer.deferred.SubmitQueue`). Raises that transfer's error, if any."""
        with self._lock, torch.cuda.device(self.device):
            self._deferred.advance(pending, steps)

    def submit_pending(self) -> None:
        """Submit every deferred step of every transfer (never waits for the device)."""
        with self._lock, torch.cuda.device(self.device):
            self._deferred.run_all()

    def _head_copier(self) -> tuple[torch.cuda.Stream, KernelCopier]:
        """The stream and gather kernel (``head_blocks`` blocks) of staged loads' head layers, made on first
        use: an engine without a head creates no stream for it."""
        if self._head is None:
            self._head = (torch.cuda.Stream(self.device, priority=-1),
                          KernelCopier(self.geometry, self.device_index, self.head_blocks, self.kernel.threads))
        return self._head

    def _head_layers(self, n: int, st: Stager) -> int:
        """Leading layers of a staged load of ``n`` pages that the gather kernel copies instead
        (``load_head_layers``, at most all layers but one): only for loads of several layer groups,
        whose first layer would otherwise be ready only once the first groups have landed."""
        L, C = self.layout.num_layers, self.layout.kv_count
        per_group = group_layers(L, C, self.geometry.piece_bytes, self.ce_min_copy_bytes, st.slot_bytes)
        if per_group >= L or n == 0 or self.lc_major:  # lc-major loads go layer by layer already
            return 0
        return min(self.load_head_layers, L - 1)

    def _load_schedule(self, n: int, st: Stager, head: int = 0,
                       layer_wise: bool = True) -> tuple[LoadSchedule, list[tuple[int, int]]]:
        """The schedule of a staged load of ``n`` pages (:func:`~hicache.transfer.staged.load_schedule`)."""
        return load_schedule(self.layout.num_layers, self.layout.kv_count, self.geometry.piece_bytes,
                             self.ce_min_copy_bytes, st.slot_bytes, n, self.stagger_ways, STAGGER_MIN_PAGES, head,
                             layer_wise, self.lc_major)

    def _staged_resident(self, host_idx: np.ndarray, to_host: bool, stream: torch.cuda.Stream, st: Stager,
                         idx_ptr: int,
                         layer_wise: bool = True) -> tuple[list[torch.cuda.Event], tuple[Any, ...], LayerFlags | None]:
        """A staged transfer whose device-side copies run as one resident kernel (``staged_resident``).

        The chunks are planned as by :meth:`_staged_load` (loads: staggered layer groups, or whole pages
        when not ``layer_wise``) or the per-chunk
        backup (whole pages). Chunk ``k`` of the stager's life gets number ``k + 1``. The copy-engine
        stream, per chunk: waits until the slot may be written (a load: the kernel finished the slot's
        previous chunk; a backup: the kernel gathered this chunk), runs the DMA, then writes the chunk's
        number to ``slot_ready``. The kernel waits for ``slot_ready`` (a load: this chunk landed; a backup:
        the slot's previous chunk drained) and publishes ``slot_done`` and the per-layer flags. Neither
        side waits for anything the other has not already been given, so the two never deadlock; the
        kernel needs SMs once per transfer, not once per chunk. The numbering and waits come from
        :func:`hicache.transfer.resident.number_chunks`, whose protocol :func:`~hicache.transfer.resident.
        check_protocol` plays out in the tests.
        """
        assert self._rt is not None
        L, C = self.layout.num_layers, self.layout.kv_count
        g = self.geometry
        piece = g.piece_bytes
        n = len(host_idx)
        # (plan, first page position, pages, first slot lc, lcs) per chunk, in order
        chunks: list[tuple[CopyPlan, int, int, int, int]] = []
        layer_chunk = np.zeros(L + (L & 1), dtype=np.int32)  # even length: packs into int64 words
        if to_host:
            per_group = group_layers(L, C, piece, L * C * piece, st.slot_bytes)  # whole pages
            for l0 in range(0, L, per_group):
                ng = min(per_group, L - l0)
                for ch in plan_group(g.host_base, g.host_page_stride, piece, C, host_idx, l0, ng, st.slot_bytes,
                                     True, STAGE_RAMP if l0 == 0 else 0, 0):
                    chunks.append((ch.plan, ch.i0, ch.i1 - ch.i0, l0 * C, ng * C))
        else:
            sched, bounds = self._load_schedule(n, st, 0, layer_wise)
            unit_end = []
            for ui, u in enumerate(sched.units):
                lo, hi = bounds[u.way]
                ramp_down = STAGE_RAMP if ui == len(sched.units) - 1 else 0
                for ch in plan_group(g.host_base, g.host_page_stride, piece, C, host_idx[lo:hi], u.layer_begin,
                                     u.n_layers, st.slot_bytes, False, 0, ramp_down):
                    chunks.append((ch.plan, lo + ch.i0, ch.i1 - ch.i0, u.layer_begin * C, u.n_layers * C))
                unit_end.append(len(chunks) - 1)
            layer_chunk[:L] = [unit_end[sched.ready[layer]] for layer in range(L)]
        if st.chunk_seq + len(chunks) >= SEQ_LIMIT or st.layer_seq + 1 >= SEQ_LIMIT:
            st.restart_flags()
        desc = np.empty((len(chunks), STAGED_DESC_WORDS), dtype=np.int64)
        taken = [st.take() for _ in chunks]
        numbered = number_chunks([s for s, _ in taken], st.last, st.chunk_seq + 1, to_host)
        st.chunk_seq += len(chunks)
        issue: list[tuple[CopyPlan, ResidentChunk]] = []  # (plan into/out of the slot, numbering)
        for k, ((plan, i0, npg, lc0, nlc), (s, base), rc) in enumerate(zip(chunks, taken, numbered, strict=True)):
            desc[k] = (s, rc.kernel_wait, rc.number, base, i0, npg, lc0, nlc)
            issue.append((with_slot_base(plan, base, to_host), rc))
        layer_seq = 0
        if not to_host:
            st.layer_seq += 1
            layer_seq = st.layer_seq
        meta_host = torch.from_numpy(np.concatenate([desc.ravel(), layer_chunk.view(np.int64)])).pin_memory()
        sst = st.stream
        ssh, sh = sst.cuda_stream, stream.cuda_stream
        with torch.cuda.stream(sst):  # allocated on the stream that uses it
            meta = torch.empty(meta_host.shape, dtype=torch.int64, device=self.device)
        self.stage_kernel.fetch_indices(ssh, meta_host.data_ptr(), meta.data_ptr(), meta.numel())
        self.stage_kernel.launch_resident(
            ssh, self.resident_blocks, meta.data_ptr(), len(chunks), idx_ptr, st.pos.data_ptr(),
            st.slot_ready.data_ptr(), st.slot_done.data_ptr(), st.counters.data_ptr(),
            meta.data_ptr() + 8 * desc.size, 0 if to_host else L, st.layer_flags.data_ptr(), layer_seq, to_host)
        kernel_done = torch.cuda.Event()
        kernel_done.record(sst)
        mo, ctx = self._mem_ops, self._mem_context
        ready_ptr, done_ptr = st.slot_ready.data_ptr(), st.slot_done.data_ptr()
        issued = 0
        try:
            for plan, rc in issue:
                if rc.dma_wait:  # a backup: gathered into the slot; a load: the slot's previous chunk scattered
                    mo.wait_geq(sh, done_ptr + 4 * rc.slot, rc.dma_wait, ctx)
                self._rt.run(plan, sh)
                mo.write(sh, ready_ptr + 4 * rc.slot, rc.number, ctx)
                issued += 1
        except BaseException:
            # The kernel is queued and would wait forever for flags this loop never wrote: release it
            # (a failed load's pages then hold stale slot bytes; the caller gets the error, not a handle).
            for _, rc in issue[issued:]:
                with contextlib.suppress(Exception):
                    mo.write(sh, ready_ptr + 4 * rc.slot, rc.number, ctx)
            raise
        stream.wait_event(kernel_done)
        final = torch.cuda.Event()
        final.record(stream)
        flags = None if to_host else LayerFlags(mo, st.layer_flags.data_ptr(), layer_seq, ctx)
        return [final] * L, (meta_host, meta), flags

    def load(self, host_idx: np.ndarray, device_idx: np.ndarray, layer_wise: bool = True) -> TransferHandle:
        """See :meth:`TransferEngine.load`. A staged load that is not ``layer_wise`` moves whole pages (one
        layer group, no stagger, no head), at the copy engine's full rate (H200, 32-layer loads of 4-16 KiB
        pieces: 0.99 of the link, against 0.89-0.95 in staggered layer groups)."""
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
