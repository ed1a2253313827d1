"""L2 <-> L1 page-transfer bandwidth on a GPU, each figure next to the in-run ceiling.

In one run (needs a CUDA GPU and CuPy):

1. Ceilings: one contiguous pinned-host <-> GPU copy of the same bytes (each way, and both ways at once
   on two streams), measured at the start (ratios use these) and again at the end (a drift check).
2. Per piece size (bytes of one page's K or V for one layer; 4 KiB .. 2 MiB) and each direction, on
   random page indices: GB/s of the kernel path (``io_backend=kernel``), the copy-engine path
   (``io_backend=copy_engine``: merged runs, ``cudaMemcpyBatchAsync``), the staged path
   (``io_backend=staged``: per-page runs by DMA through a device staging slot, then a device-side
   scatter/gather; loads also as a whole, ``layer_wise=False``, which moves whole pages instead of
   staggered layer groups), and a per-page ``cudaMemcpyAsync`` loop issued from Python; with
   ``--staged-variants``, the staged path again with other engine options (``stage_lanes=1``...).
3. Slowdown of a bf16 8192^3 GEMM stream while loads (or backups) run next to it: one contiguous
   pinned copy (the ceiling under that load: the GEMM's own memory traffic slows DMA too), the kernel
   path at several grid sizes and the copy engine (64 KiB pieces), and the staged path (4 KiB pieces,
   where ``auto`` picks it; loads also with 64 MiB of staging instead of 256); copy-engine backups go
   fanned out over four streams (the default) and on one. Each transfer is given against the idle
   ceiling and against the contiguous copy next to the same GEMM. Section ``sdpa``: the same against
   causal flash attention (``scaled_dot_product_attention``, bf16 prefill), whose many short thread
   blocks let a waiting high-priority copy kernel in between them, where the GEMM's persistent kernels
   hold every SM.
4. Load and backup at once against the bidirectional ceiling, for 4 KiB, 64 KiB and 1 MiB pieces, each
   path and ``auto`` (copy-engine backups fanned over 4 streams, and over 1).
5. A 32-layer load overlapped with per-layer compute (GEMMs after ``wait_layer(i)``) against
   max(load alone, compute alone), for compute/load ratios of about 0.5, 1 and 2, with when layer 0 was
   ready (compute's earliest start), how long compute itself took beside the load and how long it then
   waited for later layers (the overlapped time is about the sum of the three), and the same run with
   nothing holding the compute stream while the host submits the load ("not held": what a serving loop
   sees, the host's submission time included); 64 KiB pieces (every
   path), 16 and 8 KiB (staged, staggered or not) and 4 KiB pieces (kernel, and staged by groups of 8
   layers staggered 1, 2 and 4 ways, and by groups of 4 not staggered and staggered 4 ways), each staged
   size also with chunk DMAs over 2 streams; or, with ``--overlap-variants``, the default staged path
   and the variants given, at every size asked.

The L2 pool is page-first by default; ``--host-layout block_first`` (or ``layer_first``) runs every
section on another layout. ``--host-pages allocated`` takes the host pages from an L2 allocator after
churn (requests of about ``--alloc-run`` pages allocated, and freed at random or, with ``--alloc-frees
lru``, oldest first) instead of a random
permutation: a block-first pool's staged copies are runs of consecutive pages, which random pages do
not have. Device pages are random either way.

Transfers are timed with CUDA events on the compute stream, which is held by ``torch.cuda._sleep`` while
the host submits, so the figures are device time; host submission time is reported beside them.

    python benchmarks/transfer_bandwidth.py [--json out/transfer_bandwidth.json] [--total-mib 256]
"""

from __future__ import annotations

import os

# as `hicache` itself does at start (before CUDA starts): hardware queues enough for the staged path's lanes,
# and command buffers that hold a burst of its copies without stalling the host
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_SCALE_LAUNCH_QUEUES", "4x")

import argparse
import contextlib
import ctypes
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from hicache.layout import KVLayout
from hicache.pool import DevicePool, HostPool, PageAllocator
from hicache.transfer import TransferHandle, create_engine
from hicache.transfer.copy_engine import CopyPlan, CudaRuntime
from hicache.transfer.cuda import CudaHandle, CudaTransferEngine

PIECES_KIB = (4, 16, 64, 256, 1024, 2048)
SLEEP_CYCLES = 40_000_000  # ~20 ms: covers host submission so events time the device only
OVERLAP_HOLD = 3 * SLEEP_CYCLES  # the overlap's loads may take longer to submit (printed beside)
HOLD_MARGIN_S = 0.005  # the compute section's hold outlasts its host wait by this: compute queues behind it
GB = 1e9
ENGINE_OPTIONS: dict[str, int | str] = {}  # --options: under every engine's own options
HOST: dict[str, Any] = {"layout": "page_first", "pages": "random", "alloc_run": 64,
                        "alloc_frees": "random", "block_pages": 0}  # --host-* and --alloc-* options


def allocated_pages(cap: int, n: int, rng: np.random.Generator, mean_run: int, lru: bool = False) -> np.ndarray:
    """``n`` host pages as the L2 allocator hands them out to requests after churn.

    A ``PageAllocator`` of ``cap`` pages is filled and then churned: allocations of a uniform
    ``mean_run / 2 .. 3 * mean_run / 2`` pages each (at most half the pool: large pages make small
    pools), with earlier allocations freed whenever one does
    not fit: random ones (the default, the harsh case), or the oldest first (``lru``, as LRU eviction
    of whole requests would). The transfer's pages are then allocated the same way, request by request.
    """
    alloc = PageAllocator(cap)
    live: list[np.ndarray] = []

    def take(size: int) -> np.ndarray:
        while alloc.free_pages < size and live:
            alloc.free(live.pop(0 if lru else int(rng.integers(len(live)))))
        got = alloc.alloc(size)
        assert got is not None
        return got

    hi = max(1, min(3 * mean_run // 2, cap // 2))  # a request never outgrows half the pool
    lo = max(1, min(mean_run // 2, hi))
    for _ in range(max(8, 4 * cap // max(1, mean_run))):
        live.append(take(int(rng.integers(lo, hi + 1))))
    out: list[np.ndarray] = []
    got = 0
    while got < n:
        a = take(min(n - got, int(rng.integers(lo, hi + 1))))  # held: never freed for a later one
        out.append(a)
        got += len(a)
    return np.concatenate(out).astype(np.int64)


def mean_run_pages(pages: np.ndarray) -> float:
    """Mean length of the runs of consecutive page numbers in ``pages`` (as a set)."""
    p = np.sort(pages)
    return len(p) / (1 + int(np.count_nonzero(np.diff(p) != 1))) if len(p) else 0.0


def ev() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


# ---------------------------------------------------------------------- ceilings
def ceiling(nbytes: int, reps: int) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2.random_(0, 256)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    out: dict[str, list[float]] = {"h2d": [], "d2h": [], "bidir": []}
    for r in range(reps + 1):
        for kind in ("h2d", "d2h", "bidir"):
            torch.cuda.synchronize()
            a, b = ev(), ev()
            a.record()
            s1.wait_stream(torch.cuda.current_stream())
            s2.wait_stream(torch.cuda.current_stream())
            if kind in ("h2d", "bidir"):
                with torch.cuda.stream(s1):
                    dev.copy_(host, non_blocking=True)
            if kind in ("d2h", "bidir"):
                with torch.cuda.stream(s2):
                    host2.copy_(dev2, non_blocking=True)
            torch.cuda.current_stream().wait_stream(s1)
            torch.cuda.current_stream().wait_stream(s2)
            b.record()
            b.synchronize()
            if r:
                moved = 2 * nbytes if kind == "bidir" else nbytes
                out[kind].append(moved / (a.elapsed_time(b) / 1e3) / GB)
    del host, host2, dev, dev2
    return {k: median(v) for k, v in out.items()}


# ---------------------------------------------------------------------- timing helpers
def sleep_rate() -> float:
    """``torch.cuda._sleep`` cycles per second on this GPU (timed once, 20 ms)."""
    torch.cuda.synchronize()
    a, b = ev(), ev()
    a.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    b.record()
    b.synchronize()
    return SLEEP_CYCLES / (a.elapsed_time(b) / 1e3)


def time_device(submit: Callable[[], list[TransferHandle]], num_layers: int, reps: int) -> tuple[float, float]:
    """(device seconds, host submission seconds), medians. The compute stream sleeps while submitting."""
    dev_t, host_t = [], []
    for r in range(reps + 1):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        a, b = ev(), ev()
        a.record()
        t0 = time.perf_counter()
        handles = submit()
        for h in handles:
            h.wait_layer(num_layers - 1)  # submits what a layer-wise load deferred: host time too
        t1 = time.perf_counter()
        b.record()
        b.synchronize()
        for h in handles:
            h.wait()
        if r:
            dev_t.append(a.elapsed_time(b) / 1e3)
            host_t.append(t1 - t0)
    return median(dev_t), median(host_t)


def time_loop(rt: CudaRuntime, plan: CopyPlan, stream: torch.cuda.Stream, reps: int) -> float:
    """Wall seconds for one ``cudaMemcpyAsync`` per piece issued from Python, synchronised."""
    ts = []
    for r in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rt.run(plan, stream.cuda_stream, batched=False)
        stream.synchronize()
        if r:
            ts.append(time.perf_counter() - t0)
    return median(ts)


def layout_for_piece(piece: int, num_layers: int) -> KVLayout:
    # K or V of one layer: page_size tokens x 8 heads x 128 dims x bf16 = page_size * 2 KiB
    if piece % 2048:
        raise ValueError(f"piece size must be a multiple of 2 KiB, got {piece}")
    return KVLayout(num_layers=num_layers, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=piece // 2048)


class Setup:
    """Pools with random contents, and page pairs moving ``total`` bytes per transfer: random device
    pages; host pages random or allocated (``HOST``), in an L2 pool of ``HOST["layout"]``."""

    def __init__(self, layout: KVLayout, total: int, seed: int = 0, spare: int = 2) -> None:
        self.layout = layout
        self.n = max(1, total // layout.bytes_per_page)
        self.bytes = self.n * layout.bytes_per_page
        cap = spare * self.n
        self.dev = DevicePool(layout, cap, "cuda")
        self.host = HostPool(layout, cap, HOST["layout"], block_pages=HOST["block_pages"])
        self.host.buffer.view(torch.uint8).random_(0, 256)
        for row in self.dev.kv:
            for t in row:
                t.view(torch.uint8).random_(0, 256)
        rng = np.random.default_rng(seed)
        self.d = rng.permutation(cap)[: self.n].astype(np.int64)
        if HOST["pages"] == "allocated":
            self.h = rng.permutation(allocated_pages(cap, self.n, rng, HOST["alloc_run"],
                                                     HOST["alloc_frees"] == "lru"))
        else:
            self.h = rng.permutation(cap)[: self.n].astype(np.int64)
        self.mean_host_run = mean_run_pages(self.h)
        print(f"  [{layout.bytes_per_layer_piece >> 10} KiB pieces, {layout.num_layers} layers: {self.n} pages, "
              f"host {HOST['layout']} (blocks of {self.host.block_pages}), {HOST['pages']} host pages in runs "
              f"of {self.mean_host_run:.1f} on average]", flush=True)
        self.d2 = np.setdiff1d(np.arange(cap), self.d)[: self.n]
        self.h2 = np.setdiff1d(np.arange(cap), self.h)[: self.n]
        torch.cuda.synchronize()

    def engine(self, **kw: Any) -> CudaTransferEngine:
        e = create_engine("cuda", self.dev, self.host, **{**ENGINE_OPTIONS, **kw})
        assert isinstance(e, CudaTransferEngine)
        return e


# ---------------------------------------------------------------------- sections
class Burst(NamedTuple):
    """Transfers submitted back to back, with events around them on their stream."""

    handles: list[TransferHandle]
    start: torch.cuda.Event
    end: torch.cuda.Event


class _EventHandle(TransferHandle):
    """A whole transfer finished at one event (every layer at once)."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait_layer(self, layer: int) -> None:
        torch.cuda.current_stream().wait_event(self.event)

    def wait(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return bool(self.event.query())


class PinnedCopy:
    """The ceiling as a transfer engine: one contiguous pinned-host <-> GPU copy of ``nbytes`` per call,
    on high-priority streams like the engine's (for the ceiling under a concurrent GEMM)."""

    def __init__(self, nbytes: int) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.load_stream = torch.cuda.Stream(priority=-1)
        self.backup_stream = torch.cuda.Stream(priority=-1)

    def _copy(self, stream: torch.cuda.Stream, to_host: bool) -> TransferHandle:
        stream.wait_stream(torch.cuda.current_stream())  # as the engine does: start after work queued before
        with torch.cuda.stream(stream):
            if to_host:
                self.host.copy_(self.dev, non_blocking=True)
            else:
                self.dev.copy_(self.host, non_blocking=True)
            e = torch.cuda.Event()
            e.record(stream)
        return _EventHandle(e)

    def load(self, host_idx: np.ndarray, device_idx: np.ndarray) -> TransferHandle:
        return self._copy(self.load_stream, False)

    def backup(self, device_idx: np.ndarray, host_idx: np.ndarray) -> TransferHandle:
        return self._copy(self.backup_stream, True)

    def close(self) -> None:
        torch.cuda.synchronize()


def parse_variant(text: str) -> dict[str, int | str]:
    """``"stage_lanes=8,lc_copies=pitched"`` -> keyword options (integers where the value is one);
    ``"default"`` -> none."""
    if text == "default":
        return {}
    out: dict[str, int | str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not value:
            raise argparse.ArgumentTypeError(f"variant {text!r}: expected key=value[,key=value...]")
        out[key.strip()] = int(value) if value.lstrip("-").isdigit() else value.strip()
    return out


def parse_config(text: str) -> tuple[str, str, dict[str, int | str]]:
    """``"h2d:staged:staging_bytes=536870912"`` -> a compute section's row: direction, path, options
    (``piece_kib`` and ``layer_wise`` among them, as in the fixed rows)."""
    direction, _, rest = text.partition(":")
    backend, _, opts = rest.partition(":")
    if direction not in ("h2d", "d2h") or backend not in ("pinned", "kernel", "copy_engine", "staged"):
        raise argparse.ArgumentTypeError(f"config {text!r}: expected h2d|d2h:pinned|kernel|copy_engine|staged"
                                         "[:key=value,...]")
    return direction, backend, parse_variant(opts) if opts else {}


def _load(eng: CudaTransferEngine | PinnedCopy, s: Setup) -> list[TransferHandle]:
    return [eng.load(s.h, s.d)]


def _load_whole(eng: CudaTransferEngine, s: Setup) -> list[TransferHandle]:
    """A load the caller waits for as a whole (``layer_wise=False``: staged loads move whole pages)."""
    return [eng.load(s.h, s.d, layer_wise=False)]


def joined_loads(eng: CudaTransferEngine, load: Callable[..., TransferHandle]) -> Callable[..., TransferHandle]:
    """``eng.load`` as staged loads were queued until December 2026: the load stream waits for each load's
    last scatter, so the next load's DMAs start only once it ran (the pseudo-option ``join_loads=1`` of
    the compute sections and of ``staged_timeline.py``, to compare with the engine as it is)."""
    def call(*a: Any, **kw: Any) -> TransferHandle:
        h = load(*a, **kw)
        if isinstance(h, CudaHandle):
            h.submit()  # its last event is recorded once every unit is submitted
        events = getattr(h, "events", None)
        if events:
            eng.load_stream.wait_event(events[-1])
        return h
    return call


def _backup(eng: CudaTransferEngine | PinnedCopy, s: Setup) -> list[TransferHandle]:
    return [eng.backup(s.d, s.h)]


def _both(eng: CudaTransferEngine, s: Setup) -> list[TransferHandle]:
    return [eng.load(s.h, s.d), eng.backup(s.d2, s.h2)]


def bench_pieces(args: argparse.Namespace, ceil: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    rt = CudaRuntime.get()
    for kib in args.pieces:
        piece = kib << 10
        s = Setup(layout_for_piece(piece, args.layers), args.total_mib << 20, seed=kib)
        L = s.layout.num_layers
        for direction in ("h2d", "d2h"):
            row: dict[str, Any] = {"piece_bytes": piece, "direction": direction, "bytes": s.bytes, "pages": s.n,
                                   "host_layout": HOST["layout"], "mean_host_run_pages": s.mean_host_run}
            for backend in ("kernel", "copy_engine", "staged"):
                eng = s.engine(io_backend=backend)
                if direction == "h2d":
                    t, sub = time_device(partial(_load, eng, s), L, args.reps)
                else:
                    t, sub = time_device(partial(_backup, eng, s), L, args.reps)
                row[f"{backend}_gbps"] = s.bytes / t / GB
                row[f"{backend}_submit_ms"] = sub * 1e3
                if backend == "staged" and direction == "h2d":
                    t, _ = time_device(partial(_load_whole, eng, s), L, args.reps)
                    row["staged_whole_gbps"] = s.bytes / t / GB
                    row["staged_whole_ratio"] = row["staged_whole_gbps"] / ceil[direction]
                if backend == "copy_engine":
                    plan = eng.plan(s.d, s.h, 0, L * s.layout.kv_count, direction == "d2h")
                    row["copy_engine_copies"] = plan.n_copies
                    k = min(plan.n_copies, args.loop_cap)
                    sub_plan = CopyPlan(plan.dst[:k], plan.src[:k], plan.size[:k])
                    tl = time_loop(rt, sub_plan, eng.load_stream, args.reps)
                    row["loop_gbps"] = sub_plan.nbytes / tl / GB
                    row["loop_copies"] = k
                eng.close()
            c = ceil[direction]
            for key in ("kernel", "copy_engine", "staged", "loop"):
                row[f"{key}_ratio"] = row[f"{key}_gbps"] / c
            extra = ""
            if "staged_whole_gbps" in row:
                extra += f"  staged whole {row['staged_whole_gbps']:5.1f} ({row['staged_whole_ratio']:.2f})"
            for kw in args.staged_variants:
                eng = s.engine(io_backend="staged", **kw)
                t, sub = time_device(partial(_load if direction == "h2d" else _backup, eng, s), L, args.reps)
                name = ",".join(f"{k}={v}" for k, v in kw.items()) or "default"
                gbps = s.bytes / t / GB
                var = {"gbps": gbps, "ratio": gbps / c, "submit_ms": sub * 1e3}
                extra += f"  staged {name} {gbps:5.1f} ({gbps / c:.2f}, submit {sub * 1e3:.1f} ms)"
                if direction == "h2d":
                    t, _ = time_device(partial(_load_whole, eng, s), L, args.reps)
                    var |= {"whole_gbps": s.bytes / t / GB, "whole_ratio": s.bytes / t / GB / c}
                    extra += f" whole {var['whole_gbps']:5.1f} ({var['whole_ratio']:.2f})"
                eng.close()
                row.setdefault("staged_variants", {})[name] = var
            rows.append(row)
            print(f"piece {kib:>5} KiB {direction}: kernel {row['kernel_gbps']:5.1f} GB/s "
                  f"({row['kernel_ratio']:.2f})  copy-engine {row['copy_engine_gbps']:5.1f} "
                  f"({row['copy_engine_ratio']:.2f})  staged {row['staged_gbps']:5.1f} ({row['staged_ratio']:.2f})  "
                  f"per-page loop {row['loop_gbps']:5.1f} ({row['loop_ratio']:.2f})  ceiling {c:.1f}{extra}",
                  flush=True)
    return rows


def gemm_time(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    x, y = ev(), ev()
    x.record()
    for _ in range(k):
        torch.mm(a, b)
    y.record()
    y.synchronize()
    return x.elapsed_time(y) / 1e3


@contextlib.contextmanager
def sm_carveout(n: int) -> Iterator[None]:
    """cuBLAS matmuls leave ``n`` SMs free while inside (PyTorch's SM carveout; 0: untouched): a copy
    kernel waiting beside a GEMM then finds SMs without waiting for its persistent kernels to end."""
    if not n:
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(n)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


class _PolicyWindow(ctypes.Structure):
    """``CUaccessPolicyWindow``."""

    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class _AttrValue(ctypes.Union):
    """``CUstreamAttrValue`` (64 bytes), holding an access-policy window."""

    _fields_ = [("window", _PolicyWindow), ("pad", ctypes.c_char * 64)]


class L2Persist:
    """Keep staging slots in L2 while their DMA is pending (the pseudo-option ``l2_persist=MiB`` of the
    compute sections): the device sets ``MiB`` of L2 aside for persisting lines
    (``CU_LIMIT_PERSISTING_L2_CACHE_SIZE``), and before each staged gather or scatter the engine's lane
    gets an access-policy window over that kernel's slot, hit property persisting. A backup's gather then
    leaves the slot in L2 for the DMA that reads it, whatever the compute beside it streams through L2."""

    CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
    CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
    CU_ACCESS_PROPERTY_STREAMING, CU_ACCESS_PROPERTY_PERSISTING = 1, 2
    CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE, CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE = 108, 109

    def __init__(self, mib: int) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuStreamSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        self.lib.cuCtxSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
        self.lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        self.max_persist = self._attr(self.CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE)
        self.max_window = self._attr(self.CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE)
        self.bytes = min(mib << 20, self.max_persist)
        torch.cuda.synchronize()
        self._check(self.lib.cuCtxSetLimit(self.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, self.bytes), "cuCtxSetLimit")

    def _attr(self, attr: int) -> int:
        v = ctypes.c_int(0)
        self._check(self.lib.cuDeviceGetAttribute(ctypes.byref(v), attr, torch.cuda.current_device()),
                    "cuDeviceGetAttribute")
        return int(v.value)

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what} failed: CUresult {err}")

    def window(self, stream: torch.cuda.Stream, base: int, nbytes: int) -> None:
        v = _AttrValue()
        v.window = _PolicyWindow(base, min(nbytes, self.max_window), 1.0, self.CU_ACCESS_PROPERTY_PERSISTING,
                                self.CU_ACCESS_PROPERTY_STREAMING)
        self._check(self.lib.cuStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream),
                                                  self.CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW, ctypes.byref(v)),
                    "cuStreamSetAttribute")

    def attach(self, eng: CudaTransferEngine) -> None:
        """Wrap ``eng``'s per-slot kernel launches so that each runs under a window over its slot."""
        launch = eng._launch_stage

        def wrapped(lane: torch.cuda.Stream, plans: Any, idx_ptr: int, ch: Any, shape: Any, layer_begin: int,
                    n_layers: int, to_host: bool, base: int, st: Any, lo: int = 0) -> None:
            self.window(lane, base, st.slot_bytes)
            launch(lane, plans, idx_ptr, ch, shape, layer_begin, n_layers, to_host, base, st, lo)

        eng._launch_stage = wrapped  # type: ignore[method-assign]

    def close(self) -> None:
        torch.cuda.synchronize()
        self.lib.cuCtxResetPersistingL2Cache()
        self._check(self.lib.cuCtxSetLimit(self.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 0), "cuCtxSetLimit")


class Compute(NamedTuple):
    """An attention-like load for the slowdown sections: ``time(k)`` runs ``k`` steps, returns seconds."""

    name: str
    time: Callable[[int], float]


def gemm_compute() -> Compute:
    """bf16 8192^3 GEMMs (about 1.4 ms each on an H200): every SM busy, persistent cuBLAS kernels."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    return Compute("GEMM", partial(gemm_time, a, b))


def sdpa_compute() -> Compute:
    """Causal bf16 prefill attention (``scaled_dot_product_attention``): 4 sequences x 32 heads x 4,096
    tokens x 128 dims per step, the attention of one layer of an 8B-shaped model on a 16k-token batch."""
    q, k_, v = (torch.randn(4, 32, 4096, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))

    def run(steps: int) -> float:
        x, y = ev(), ev()
        x.record()
        for _ in range(steps):
            torch.nn.functional.scaled_dot_product_attention(q, k_, v, is_causal=True)
        y.record()
        y.synchronize()
        return x.elapsed_time(y) / 1e3

    return Compute("SDPA", run)


def bench_gemm(args: argparse.Namespace, ceil: dict[str, float]) -> list[dict[str, Any]]:
    """Section 3 on GEMMs: the kernel path at every grid size of ``--blocks-sweep``."""
    configs: list[tuple[str, str, dict[str, Any]]] = [("h2d", "pinned", {}), ("d2h", "pinned", {})]
    configs += [("h2d", "kernel", {"blocks": bl}) for bl in args.blocks_sweep]
    configs += [("d2h", "kernel", {}), ("h2d", "copy_engine", {}), ("d2h", "copy_engine", {}),
                ("d2h", "copy_engine", {"backup_streams": 1}), ("h2d", "staged", {}),
                ("h2d", "staged", {"layer_wise": False}),
                ("h2d", "staged", {"stage_lanes": 1}), ("h2d", "staged", {"staging_bytes": 64 << 20}),
                ("d2h", "staged", {}), ("d2h", "staged", {"backup_streams": 1}), ("d2h", "staged", {"stage_lanes": 1}),
                ("h2d", "staged", {"staged_kernel": "resident"}), ("d2h", "staged", {"staged_kernel": "resident"}),
                ("h2d", "staged", {"staged_kernel": "resident", "resident_blocks": 1})]
    if HOST["layout"] != "page_first":  # the resident kernel needs page-first; block-first compares its stagings
        configs = [c for c in configs if c[2].get("staged_kernel") != "resident"]
        if HOST["layout"] == "block_first":
            configs += [(dr, "staged", {"block_staging": "lc_major"}) for dr in ("h2d", "d2h")]
    return bench_compute(args, ceil, gemm_compute(), configs)


def bench_sdpa(args: argparse.Namespace, ceil: dict[str, float]) -> list[dict[str, Any]]:
    """Section 3 on flash attention: every path at its default grid."""
    configs: list[tuple[str, str, dict[str, Any]]] = [
        (d, b, {}) for b in ("pinned", "kernel", "copy_engine", "staged") for d in ("h2d", "d2h")]
    configs.insert(6, ("d2h", "copy_engine", {"backup_streams": 1}))
    configs.append(("d2h", "staged", {"backup_streams": 1}))
    return bench_compute(args, ceil, sdpa_compute(), configs)


def bench_compute(args: argparse.Namespace, ceil: dict[str, float], compute: Compute,
                  configs: list[tuple[str, str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Compute time next to transfers over compute time alone, measured in alternating pairs.

    Both samples of a pair start after the same idle gap, during which the compute stream sleeps on the
    device (clock and power state alike). In the concurrent sample the host submits the transfers during
    that gap; they wait for the compute stream like any transfer does (``ready``), so they start when the
    gap ends, together with the compute queued behind it. The transfer figure is then the device's rate
    beside the compute, whatever the host's submission rate, which is printed beside it (``host submits
    one in``; the host keeps up with the device where that is under ``device``). A pair whose
    submission outlasted the gap is counted in ``late_pairs``. The first configuration of each direction
    should be ``pinned``: it gives the ceiling under that compute.
    """
    if args.compute_configs:  # the rows asked for instead of the fixed ones, after the pinned baselines
        configs = [("h2d", "pinned", {}), ("d2h", "pinned", {}), *args.compute_configs]
    k = args.gemms
    for _ in range(3):
        compute.time(k)
    setups: dict[int, Setup] = {}
    rows = []
    under: dict[str, float] = {}  # contiguous pinned copy GB/s next to the compute: the ceiling under load

    cycles_per_s = sleep_rate()
    end_stream = torch.cuda.Stream()

    def after_gap(submit: Callable[[torch.cuda.Event], Burst] | None, gap: float,
                  carve: int = 0) -> tuple[float, Burst | None, bool]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(int((gap + HOLD_MARGIN_S) * cycles_per_s))  # the compute stream idles the gap
        start = ev()
        start.record()  # on the compute stream: when the gap ends
        burst = submit(start) if submit is not None else None
        late = time.perf_counter() - t0 > gap
        time.sleep(max(0.0, t0 + gap - time.perf_counter()))
        with sm_carveout(carve):
            return compute.time(k), burst, late

    for direction, backend, kw in configs:
        kw = dict(kw)
        kib = kw.pop("piece_kib", 4 if backend == "staged" else 64)  # staged: auto's choice for small pieces
        layer_wise = kw.pop("layer_wise", True)  # False: whole loads, as a node's Prefetch makes
        join = kw.pop("join_loads", 0)  # the load stream waits for each load's end (see joined_loads)
        # SMs the compute leaves free beside the transfers (cuBLAS only); its alone samples keep them all, so
        # the slowdown includes what the carveout costs the compute
        carve = int(kw.pop("sm_carveout", 0))
        persist_mib = int(kw.pop("l2_persist", 0))  # MiB of L2 for the staging slots (see L2Persist)
        if kib not in setups:
            setups[kib] = Setup(layout_for_piece(kib << 10, args.layers), args.total_mib << 20, seed=90 + kib)
        s = setups[kib]
        L = s.layout.num_layers
        eng: CudaTransferEngine | PinnedCopy = (PinnedCopy(s.bytes) if backend == "pinned"
                                                 else s.engine(io_backend=backend, **kw))
        if join and isinstance(eng, CudaTransferEngine):
            eng.load = joined_loads(eng, eng.load)  # type: ignore[method-assign]
        persist = None
        if persist_mib and isinstance(eng, CudaTransferEngine):
            persist = L2Persist(persist_mib)
            persist.attach(eng)
        if direction == "d2h":
            one = partial(_backup, eng, s)
        elif layer_wise or not isinstance(eng, CudaTransferEngine):
            one = partial(_load, eng, s)
        else:
            one = partial(_load_whole, eng, s)
        t_alone_transfer, t_submit = time_device(one, L, args.reps)
        alone_gbps = s.bytes / t_alone_transfer / GB
        # The transfers are submitted during an idle gap before the compute starts, long enough for the
        # host to queue all of them: the figures are the device's, with the host submission time beside.
        m = max(2, math.ceil((0.01 + 1.5 * compute.time(k)) / t_alone_transfer))
        gap = max(0.01, 1.25 * m * t_submit + 0.002)
        def many(start: torch.cuda.Event, one: Callable[[], list[TransferHandle]] = one, m: int = m,
                 L: int = L) -> Burst:
            hs = [h for _ in range(m) for h in one()]
            with torch.cuda.stream(end_stream):  # the burst ends when every handle's last layer has landed
                for h in hs:
                    h.wait_layer(L - 1)
                xe = ev()
                xe.record(end_stream)
            return Burst(hs, start, xe)

        slow, gbps, alone_ms = [], [], []
        late_pairs = 0
        for _ in range(args.reps):
            t_alone, _, _ = after_gap(None, gap)
            t_conc, burst, late = after_gap(many, gap, carve)
            late_pairs += late
            assert burst is not None
            burst.end.synchronize()
            for h in burst.handles:
                h.wait()
            slow.append(t_conc / t_alone - 1)
            alone_ms.append(t_alone * 1e3)
            gbps.append(m * s.bytes / (burst.start.elapsed_time(burst.end) / 1e3) / GB)
        eng.close()
        if persist is not None:
            persist.close()
        carve_alone = 0.0
        if carve:
            carve_alone = median([after_gap(None, gap, carve)[0] for _ in range(args.reps)])
        blocks = 0
        if isinstance(eng, CudaTransferEngine):
            copier = (eng.stage_kernel if backend == "staged" else eng.kernel if direction == "h2d"
                      else eng.backup_kernel)
            blocks = kw.get("blocks", copier.blocks)
        if backend == "pinned":
            under[f"{direction}{carve}"] = median(gbps)
        base = under.get(f"{direction}{carve}", under.get(f"{direction}0", ceil[direction]))
        row: dict[str, Any] = {"compute": compute.name, "direction": direction, "backend": backend,
                               "blocks": blocks, "piece_bytes": s.layout.bytes_per_layer_piece,
                               "compute_alone_ms": median(alone_ms), "compute_slowdown": median(slow),
                               "gemm_alone_ms": median(alone_ms), "gemm_slowdown": median(slow),
                               "transfer_gbps": median(gbps), "transfer_ratio": median(gbps) / ceil[direction],
                               "transfer_alone_gbps": alone_gbps,
                               "transfer_alone_ratio": alone_gbps / ceil[direction],
                               "ratio_to_pinned_under_compute": median(gbps) / base,
                               "ratio_to_pinned_under_gemm": median(gbps) / base,
                               "host_submit_ms": t_submit * 1e3, "device_ms": t_alone_transfer * 1e3,
                               "late_pairs": late_pairs, "layer_wise": layer_wise, "options": kw,
                               "join_loads": bool(join), "sm_carveout": carve,
                               "l2_persist_bytes": persist.bytes if persist is not None else 0,
                               "compute_carveout_alone_ms": carve_alone * 1e3,
                               "carveout_slowdown": carve_alone * 1e3 / median(alone_ms) - 1 if carve else 0.0}
        rows.append(row)
        grid = {"kernel": f"{blocks} blocks", "staged": f"DMA+{blocks}", "pinned": "one copy"}.get(backend, "DMA")
        print(f"{compute.name} next to {direction} {backend:<11} ({grid:>8}, {row['piece_bytes'] >> 10:>2} KiB): "
              f"{compute.name} {100 * row['compute_slowdown']:+5.1f}%  "
              f"transfer {row['transfer_gbps']:5.1f} GB/s ({row['transfer_ratio']:.2f} of ceiling, "
              f"{row['ratio_to_pinned_under_compute']:.2f} of one pinned copy next to the {compute.name}; "
              f"alone {alone_gbps:5.1f} = {row['transfer_alone_ratio']:.2f}; host submits one in "
              f"{row['host_submit_ms']:.1f} ms, device {row['device_ms']:.1f} ms)"
              + (f" [{late_pairs} of {args.reps} submitted late]" if late_pairs else "")
              + ("" if layer_wise else " whole loads") + (" join_loads" if join else "")
              + (f" sm_carveout={carve} (alone with it {100 * row['carveout_slowdown']:+.1f}%)" if carve else "")
              + (f" l2_persist={row['l2_persist_bytes'] >> 20} MiB (of at most {persist.max_persist >> 20}, window"
                 f" at most {persist.max_window >> 20})" if persist is not None else "")
              + "".join(f" {k}={v}" for k, v in kw.items() if k != "blocks"), flush=True)
    return rows


def bench_bidir(args: argparse.Namespace, ceil: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for kib in (4, 64, 1024):
        s = Setup(layout_for_piece(kib << 10, args.layers), args.total_mib << 20, seed=7 + kib, spare=3)
        L = s.layout.num_layers
        runs: list[tuple[str, dict[str, Any]]] = [(b, {}) for b in ("kernel", "copy_engine", "staged", "auto")]
        if kib < 64:
            runs.insert(3, ("staged", {"backup_streams": 1}))
        if kib >= 64:
            runs.insert(2, ("copy_engine", {"backup_streams": 1}))
        for backend, kw in runs:
            eng = s.engine(io_backend=backend, **kw)
            t, _ = time_device(partial(_both, eng, s), L, args.reps)
            gbps = 2 * s.bytes / t / GB
            rows.append({"piece_bytes": kib << 10, "backend": backend, "gbps": gbps, "ratio": gbps / ceil["bidir"],
                         "options": kw})
            opt = "".join(f" {k}={v}" for k, v in kw.items())
            print(f"load+backup at once, {kib:>5} KiB pieces, {backend:<11}{opt}: {gbps:6.1f} GB/s "
                  f"({gbps / ceil['bidir']:.2f} of bidirectional ceiling {ceil['bidir']:.1f})", flush=True)
            eng.close()
    return rows


def _overlap_unheld(eng: CudaTransferEngine, s: Setup, a: torch.Tensor, b: torch.Tensor, k: int,
                    layers: int) -> float:
    """Seconds from the load call to the end of the per-layer compute, with nothing holding the compute
    stream while the host submits: what a serving loop that calls ``load`` and then computes sees, the
    host's submission included (layer 0's compute is queued only once ``load`` returns)."""
    torch.cuda.synchronize()
    x, y = ev(), ev()
    x.record()
    h = eng.load(s.h, s.d)
    for layer in range(layers):
        h.wait_layer(layer)
        for _ in range(k):
            torch.mm(a, b)
    y.record()
    y.synchronize()
    h.wait()
    return x.elapsed_time(y) / 1e3


def bench_overlap(args: argparse.Namespace, ceil: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    plan: list[tuple[int, list[tuple[str, dict[str, Any]]]]] = [
        (64, [("kernel", {}), ("kernel", {"layer_signal": "events"}), ("copy_engine", {}), ("staged", {})]),
        (16, [("staged", {"stagger_ways": 1}), ("staged", {}), ("staged", {"load_streams": 2})]),
        (8, [("staged", {"stagger_ways": 1}), ("staged", {"stagger_ways": 2}), ("staged", {})]),
        (4, [("kernel", {}), ("staged", {"stagger_ways": 1}), ("staged", {"stagger_ways": 2}), ("staged", {}),
             ("staged", {"stage_lanes": 1}), ("staged", {"load_streams": 2}),
             ("staged", {"ce_min_copy_bytes": 32 << 10, "stagger_ways": 1}),
             ("staged", {"ce_min_copy_bytes": 32 << 10}), ("staged", {"staged_kernel": "resident"}),
             ("staged", {"staged_kernel": "resident", "resident_blocks": 1})]),
    ]
    if args.overlap_variants:  # the default staged path, then each variant, at every piece size asked
        plan = [(kib, [("staged", {}), *(("staged", kw) for kw in args.overlap_variants if kw)])
                for kib in args.overlap_pieces]
    for kib, configs in plan:
        if HOST["layout"] != "page_first":  # the resident kernel needs a page-first L2
            configs = [c for c in configs if c[1].get("staged_kernel") != "resident"]
        if kib in args.overlap_pieces:
            rows += _overlap(args, ceil, kib << 10, configs)
    return rows


def _overlap(args: argparse.Namespace, ceil: dict[str, float], piece: int,
             configs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    n_gemm = 4096
    a = torch.randn(n_gemm, n_gemm, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n_gemm, n_gemm, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        gemm_time(a, b, 8)
    t_gemm = median([gemm_time(a, b, 32) / 32 for _ in range(3)])
    layers = 32
    layout = layout_for_piece(piece, layers)
    # per-layer load about 2 GEMMs long at the ceiling
    per_layer = 2 * t_gemm * ceil["h2d"] * GB
    s = Setup(layout, int(per_layer * layers), seed=5)
    rows = []
    for backend, kw in configs:
        kw = dict(kw)
        carve = int(kw.pop("sm_carveout", 0))  # SMs the per-layer GEMMs leave free (not while timed alone)
        eng = s.engine(io_backend=backend, **kw)
        signal = {"kernel": eng.layer_signal, "staged": "groups"}.get(backend, "events")
        if backend == "staged":  # parts whose layer groups are staggered / the copy size groups aim for
            signal = f"{eng.stagger_ways}w{eng.ce_min_copy_bytes >> 10}K"
        t_load, _ = time_device(partial(_load, eng, s), layers, args.reps)
        for k in (1, 2, 4):
            comp = []
            over = []
            first = []  # when compute could start: layer 0 ready, after the load began
            stall = []  # compute waiting for layers after it started
            beside = []  # compute time itself, beside the load
            submit = []  # host time of eng.load(): compute for layer 0 can be queued only after it
            unheld = []  # the overlapped time with nothing holding the compute stream: host time counts too
            for _ in range(args.reps):
                torch.cuda.synchronize()
                torch.cuda._sleep(OVERLAP_HOLD)  # same idle-then-busy start as the overlapped sample
                comp.append(gemm_time(a, b, k * layers))
                torch.cuda.synchronize()
                torch.cuda._sleep(OVERLAP_HOLD)
                x, y = ev(), ev()
                starts, ends = [], []
                with sm_carveout(carve):
                    x.record()
                    t0 = time.perf_counter()
                    h = eng.load(s.h, s.d)
                    submit.append(time.perf_counter() - t0)
                    for layer in range(layers):
                        h.wait_layer(layer)
                        starts.append(ev())
                        starts[-1].record()
                        for _ in range(k):
                            torch.mm(a, b)
                        ends.append(ev())
                        ends[-1].record()
                    y.record()
                    y.synchronize()
                    over.append(x.elapsed_time(y) / 1e3)
                    unheld.append(_overlap_unheld(eng, s, a, b, k, layers))
                first.append(x.elapsed_time(starts[0]) / 1e3)
                stall.append(sum(ends[i - 1].elapsed_time(starts[i]) for i in range(1, layers)) / 1e3)
                beside.append(sum(starts[i].elapsed_time(ends[i]) for i in range(layers)) / 1e3)
            t_comp, t_over, t_first = median(comp), median(over), median(first)
            t_stall, t_beside = median(stall), median(beside)
            ratio = t_over / max(t_load, t_comp)
            t_unheld = median(unheld)
            rows.append({"backend": backend, "layer_signal": signal, "layers": layers, "piece_bytes": piece,
                         "options": kw, "sm_carveout": carve,
                         "load_ms": t_load * 1e3,
                         "compute_ms": t_comp * 1e3, "overlapped_ms": t_over * 1e3, "ratio_vs_max": ratio,
                         "first_layer_ms": t_first * 1e3, "stall_ms": t_stall * 1e3,
                         "compute_beside_ms": t_beside * 1e3, "host_submit_ms": median(submit) * 1e3,
                         "unheld_ms": t_unheld * 1e3, "unheld_ratio_vs_max": t_unheld / max(t_load, t_comp),
                         "bytes": s.bytes, "host_layout": HOST["layout"], "host_pages": HOST["pages"],
                         "mean_host_run_pages": s.mean_host_run})
            print(f"32-layer overlap {piece >> 10:>3} KiB {backend:<11} {signal:<6} "
                  f"compute/load {t_comp / t_load:4.2f}: load {t_load * 1e3:6.2f} ms, "
                  f"compute {t_comp * 1e3:6.2f} ms, layer 0 at {t_first * 1e3:5.2f}, "
                  f"overlapped {t_over * 1e3:6.2f} ms = {ratio:.3f} x max (compute beside the load "
                  f"{t_beside * 1e3:6.2f} ms, waits after layer 0 {t_stall * 1e3:5.2f} ms; host submits the load "
                  f"in {median(submit) * 1e3:5.1f} ms; not held: {t_unheld * 1e3:6.2f} ms = "
                  f"{t_unheld / max(t_load, t_comp):.3f} x max)"
                  + "".join(f" {k}={v}" for k, v in kw.items() if k not in ("stagger_ways", "ce_min_copy_bytes"))
                  + (f" sm_carveout={carve}" if carve else ""),
                  flush=True)
        eng.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="out/transfer_bandwidth.json")
    p.add_argument("--total-mib", type=int, default=256, help="bytes per timed transfer")
    p.add_argument("--layers", type=int, default=8, help="layers of the pools in the piece-size sweep")
    p.add_argument("--pieces", type=int, nargs="+", default=list(PIECES_KIB), help="piece sizes in KiB")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--overlap-pieces", type=int, nargs="+", default=[64, 4], help="piece sizes (KiB) of the overlap")
    p.add_argument("--gemms", type=int, default=12,
                   help="compute steps per slowdown sample (8192^3 GEMMs, or SDPA calls)")
    p.add_argument("--options", type=parse_variant, default={},
                   help="engine options key=value[,key=value...] for every engine of the run (a row's own options "
                        "take precedence)")
    p.add_argument("--staged-variants", type=parse_variant, nargs="*", default=[],
                   help="section pieces: more staged columns, engine options key=value[,key=value...] each")
    p.add_argument("--overlap-variants", type=parse_variant, nargs="*", default=[],
                   help="section overlap: instead of the fixed set of paths, the default staged path and these "
                        "staged variants (key=value[,key=value...] each; 'default' for none) at every "
                        "--overlap-pieces size")
    p.add_argument("--compute-configs", type=parse_config, nargs="*", default=[],
                   help="sections gemm, sdpa: instead of the fixed rows, the pinned copies and these rows, each "
                        "DIRECTION:PATH[:key=value,...] (h2d|d2h, pinned|kernel|copy_engine|staged; options "
                        "include piece_kib, layer_wise=0, sm_carveout=N: the GEMMs leave N SMs free, slowdown still "
                        "against the GEMM on every SM, and l2_persist=MiB: staging slots persist in L2 until their "
                        "DMA, see L2Persist)")
    p.add_argument("--blocks-sweep", type=int, nargs="+", default=[4, 1, 2, 8])
    p.add_argument("--loop-cap", type=int, default=8192, help="most copies timed in the per-page loop")
    p.add_argument("--host-layout", default="page_first", choices=["page_first", "layer_first", "block_first"],
                   help="layout of the L2 pool in every section")
    p.add_argument("--host-block-pages", type=int, default=0,
                   help="--host-layout block_first: pages per block (0: the pool's default for the piece size)")
    p.add_argument("--host-pages", default="random", choices=["random", "allocated"],
                   help="host pages of each transfer: a random permutation, or as the allocator hands them out")
    p.add_argument("--alloc-run", type=int, default=64, help="--host-pages allocated: mean pages per request")
    p.add_argument("--alloc-frees", default="random", choices=["random", "lru"],
                   help="--host-pages allocated: which allocations the churn frees (random: the harsh case)")
    p.add_argument("--sections", nargs="+", default=["pieces", "gemm", "sdpa", "bidir", "overlap"],
                   choices=["pieces", "gemm", "sdpa", "bidir", "overlap"])
    args = p.parse_args(argv)
    ENGINE_OPTIONS.update(args.options)
    HOST.update(layout=args.host_layout, pages=args.host_pages, alloc_run=args.alloc_run,
                alloc_frees=args.alloc_frees, block_pages=args.host_block_pages)
    if not torch.cuda.is_available():
        print("transfer_bandwidth: needs a CUDA GPU", file=sys.stderr)
        return 2
    import cupy

    rt = CudaRuntime.get()
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cupy": cupy.__version__,
            "cudart": rt.version, "batched_memcpy": rt.has_batch, "python": platform.python_version()}
    print(json.dumps(info), flush=True)
    ceil0 = ceiling(args.total_mib << 20, args.reps)
    print(f"ceiling (start): h2d {ceil0['h2d']:.1f} GB/s, d2h {ceil0['d2h']:.1f}, both at once {ceil0['bidir']:.1f}",
          flush=True)
    ceil = dict(ceil0)
    result: dict[str, Any] = {"info": info, "args": vars(args), "ceiling_start": ceil0}
    if "pieces" in args.sections:
        result["pieces"] = bench_pieces(args, ceil)
    if "gemm" in args.sections:
        result["gemm"] = bench_gemm(args, ceil)
    if "sdpa" in args.sections:
        result["sdpa"] = bench_sdpa(args, ceil)
    if "bidir" in args.sections:
        result["bidir"] = bench_bidir(args, ceil)
    if "overlap" in args.sections:
        result["overlap"] = bench_overlap(args, ceil)
    ceil1 = ceiling(args.total_mib << 20, args.reps)
    result["ceiling_end"] = ceil1
    print(f"ceiling (end):   h2d {ceil1['h2d']:.1f} GB/s, d2h {ceil1['d2h']:.1f}, both at once {ceil1['bidir']:.1f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
