"""Copy-engine path: page copies as DMA transfers (``cudaMemcpyBatchAsync``, else ``cudaMemcpyAsync``).

:func:`plan_copies` turns a page list into ``(dst, src, size)`` byte copies, merging runs of pages that
are consecutive on both sides into one copy where the memory is contiguous (layer-first host layout, or
per-layer device tensors on the device side). :class:`CudaRuntime` issues a plan on a stream: one
``cudaMemcpyBatchAsync`` call per batch where the CUDA runtime has it (12.8+), one ``cudaMemcpyAsync``
per copy otherwise. The copy engine uses no SMs, so it is free next to attention when the copies are
large; with many small scattered pieces it is slower than the kernel.

Planning is pure NumPy and needs no GPU.
"""

from __future__ import annotations

import ctypes
import glob
import itertools
import os
import sys
import threading
from typing import NamedTuple

import numpy as np

CUDA_MEMCPY_DEFAULT = 4
SRC_ACCESS_ORDER_STREAM = 1
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
# One cudaMemcpyBatchAsync call carries at most MAX_BATCH copies. Larger batches of small copies could
# hang their stream for good: on an H200 (driver 580, CUDA 13.0 runtime), in a fresh process, one batch of
# 512 or 600 copies of 16 KiB never completed (nor, for that, a 600 MB staged load whose first chunk was such
# a batch), while 256-400 of them, 600 of 4 KiB and 600 of 64 KiB did, and a process that had run other
# copies first often did not hang. Capped at 256, batches of 600 and 2,000 copies of 16 KiB and 8,192 of
# 4 KiB ran; ``tests/cuda`` runs such first batches in a fresh process. Capping bytes as well (4 MiB) cost
# staged 4 KiB loads 4% of the link (more calls for their 64 KiB copies) and was dropped.
MAX_BATCH = 256


def batch_bounds(n: int, max_copies: int = MAX_BATCH) -> list[int]:
    """Where a plan of ``n`` copies is cut into runtime batches of at most ``max_copies``: ``[0, ..., n]``."""
    return [*range(0, n, max_copies), n] if n else [0]


class CopyPlan(NamedTuple):
    """Byte copies: ``dst[i] <- src[i]`` of ``size[i]`` bytes (uint64 addresses)."""

    dst: np.ndarray
    src: np.ndarray
    size: np.ndarray

    @property
    def n_copies(self) -> int:
        return len(self.size)

    @property
    def nbytes(self) -> int:
        return int(self.size.sum())


def plan_copies(dev_ptrs: np.ndarray, host_base: int, host_page_stride: int, host_lc_stride: int,
                piece_bytes: int, dev_idx: np.ndarray, host_idx: np.ndarray, lc_begin: int, n_lc: int,
                to_host: bool) -> CopyPlan:
    """Copies for slots ``[lc_begin, lc_begin + n_lc)`` of the page pairs ``(dev_idx[i], host_idx[i])``.

    Addresses as in ``kernels/page_copy.cu``. Within each slot the copies go in ascending host address
    (pairs ordered by host page), the order in which host memory is written fastest over PCIe. A run of
    pairs whose device and host pages both step by one becomes a single copy when the host piece stride
    equals the piece size (then both sides are contiguous), otherwise each pair stays one copy.
    """
    dev_idx = np.asarray(dev_idx, dtype=np.int64)
    host_idx = np.asarray(host_idx, dtype=np.int64)
    n = len(dev_idx)
    if n == 0 or n_lc <= 0:
        empty = np.zeros(0, dtype=np.uint64)
        return CopyPlan(empty, empty, empty)
    order = np.argsort(host_idx, kind="stable")
    d = dev_idx[order]
    h = host_idx[order]
    if host_page_stride == piece_bytes:
        brk = np.ones(n, dtype=bool)
        brk[1:] = (np.diff(d) != 1) | (np.diff(h) != 1)
        starts = np.flatnonzero(brk)
        lengths = np.diff(np.append(starts, n))
        d, h = d[starts], h[starts]
    else:
        lengths = np.ones(n, dtype=np.int64)
    lc = np.arange(lc_begin, lc_begin + n_lc, dtype=np.int64)
    ptrs = np.asarray(dev_ptrs, dtype=np.uint64)[lc].astype(np.int64)
    dev_addr = (ptrs[:, None] + d[None, :] * piece_bytes).reshape(-1)
    host_addr = (host_base + h[None, :] * host_page_stride + lc[:, None] * host_lc_stride).reshape(-1)
    size = np.tile(lengths * piece_bytes, n_lc)
    dev_u = dev_addr.astype(np.uint64)
    host_u = host_addr.astype(np.uint64)
    if to_host:
        return CopyPlan(host_u, dev_u, size.astype(np.uint64))
    return CopyPlan(dev_u, host_u, size.astype(np.uint64))


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


def _load_cudart() -> ctypes.CDLL:
    """The CUDA runtime already loaded by torch/CuPy (matched by soname), else one found on disk."""
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    roots = [os.path.join(p, "nvidia") for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))]
    for root in roots:
        for cand in sorted(glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True), reverse=True):
            try:
                return ctypes.CDLL(cand)
            except OSError:
                pass
    raise OSError("libcudart not found")


class CudaRuntime:
    """The few CUDA runtime calls the copy-engine path needs, through ctypes.

    One per process (:meth:`get`). :meth:`run` cuts a plan into batched calls of at most ``max_batch``
    copies (``MAX_BATCH``; a measurement may set another size on the instance, below 512: see
    ``MAX_BATCH`` for why larger batches are unsafe).
    """

    _instance: CudaRuntime | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        lib = _load_cudart()
        self._lib = lib
        ver = ctypes.c_int(0)
        lib.cudaRuntimeGetVersion(ctypes.byref(ver))
        self.version = ver.value
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        self._batch = getattr(lib, "cudaMemcpyBatchAsync", None) if self.version >= 12080 else None
        if self._batch is not None:
            self._batch.restype = ctypes.c_int
            if self.version >= 13000:
                self._batch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            else:  # 12.8 - 12.9 carry a failIdx out-parameter before the stream
                self._batch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                        ctypes.c_void_p]
        self._attrs = _MemcpyAttributes()
        self._attrs.srcAccessOrder = SRC_ACCESS_ORDER_STREAM
        self._attrs.flags = FLAG_PREFER_OVERLAP_WITH_COMPUTE
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._fail_idx = ctypes.c_size_t(0)
        self.batch_error: str | None = None  # set when the batched call failed and per-copy calls took over
        self.max_batch = MAX_BATCH  # most copies per batched call (see the class docstring)

    @classmethod
    def get(cls) -> CudaRuntime:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            msg = self._lib.cudaGetErrorString(err)
            raise RuntimeError(f"{what} failed: {msg.decode() if msg else err}")

    def memcpy_async(self, dst: int, src: int, size: int, stream: int) -> None:
        self._check(self._lib.cudaMemcpyAsync(dst, src, size, CUDA_MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")

    def run(self, plan: CopyPlan, stream: int, batched: bool = True) -> int:
        """Issue every copy of ``plan`` on ``stream``; returns the number of runtime calls made."""
        if plan.n_copies == 0:
            return 0
        if not (batched and self._batch is not None):
            for dst, src, size in zip(plan.dst.tolist(), plan.src.tolist(), plan.size.tolist(), strict=True):
                self.memcpy_async(dst, src, size, stream)
            return plan.n_copies
        calls = 0
        bounds = batch_bounds(plan.n_copies, self.max_batch)
        for lo, hi in itertools.pairwise(bounds):
            dst = np.ascontiguousarray(plan.dst[lo:hi])
            src = np.ascontiguousarray(plan.src[lo:hi])
            size = np.ascontiguousarray(plan.size[lo:hi])
            args: list[object] = [dst.ctypes.data, src.ctypes.data, size.ctypes.data, hi - lo,
                                  ctypes.addressof(self._attrs), ctypes.addressof(self._attr_idx), 1]
            if self.version < 13000:
                args.append(ctypes.addressof(self._fail_idx))
            args.append(stream)
            err = self._batch(*args)  # type: ignore[misc]
            if err != 0:
                # The runtime rejected the batch before enqueueing anything: remember why, issue the
                # remaining copies one by one, and use per-copy calls from now on.
                msg = self._lib.cudaGetErrorString(err)
                self.batch_error = msg.decode() if msg else str(err)
                self._batch = None
                rest = CopyPlan(plan.dst[lo:], plan.src[lo:], plan.size[lo:])
                return calls + self.run(rest, stream, batched=False)
            calls += 1
        return calls
