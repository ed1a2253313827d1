"""SMs set aside for the transfer engine's kernels: the device split into two green contexts.

The staged path's scatter/gather kernels (and the kernel path's copy kernels) need a few SMs for a few
microseconds per chunk. Beside compute whose kernels hold every SM (a GEMM's persistent kernels, about
1.4 ms each for a bf16 8192^3 GEMM on an H200), they wait for SMs to free up, and the copy engine runs out
of filled staging slots. CUDA green contexts (driver API, CUDA 12.4+) partition the SMs: work launched
into a green context's streams runs only on that context's SMs. :class:`SmPartition` makes two
disjoint ones, ``reserved`` SMs for the engine's streams and the rest for compute. Compute must be
launched into :meth:`SmPartition.compute_stream` for the reservation to hold: work on any other stream
may still run on every SM, the reserved ones included.

A partition is rounded up by the driver to the device's SM group size (8 on Hopper). Device memory,
modules and events are shared with the primary context, so kernels loaded there run on these streams,
and events order work across them as across any two streams.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any

import torch

from hicache.transfer.cuda_driver import _Driver

CU_DEV_RESOURCE_TYPE_SM = 1
CU_GREEN_CTX_DEFAULT_STREAM = 0x1
CU_STREAM_NON_BLOCKING = 0x1
_RESOURCE_BYTES = 512  # sizeof(CUdevResource) is 144-152 bytes across CUDA 12.4-13; room to spare
_SM_COUNT_OFFSET = 96  # CUdevResource: type (4 bytes), padding (92), then the SM union's smCount


class _GreenDriver(_Driver):
    """The green-context entry points; raises ``OSError`` where the driver lacks them (before 12.4)."""

    def __init__(self) -> None:
        super().__init__()
        p, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        pp = ctypes.POINTER(ctypes.c_void_p)
        self._fns: dict[str, Any] = {}
        for names, args in ((("cuDeviceGet",), [ctypes.POINTER(ctypes.c_int), i]),
                            (("cuDeviceGetDevResource",), [i, p, i]),
                            (("cuDevSmResourceSplitByCount",), [p, ctypes.POINTER(ctypes.c_uint), p, p, u, u]),
                            (("cuDevResourceGenerateDesc",), [pp, p, u]),
                            (("cuGreenCtxCreate",), [pp, p, i, u]),
                            (("cuGreenCtxStreamCreate",), [pp, p, u, i]),
                            (("cuGreenCtxDestroy",), [p]),
                            (("cuStreamDestroy_v2", "cuStreamDestroy"), [p])):
            fn = self._entry(*names)
            fn.restype = ctypes.c_int
            fn.argtypes = args
            self._fns[names[0]] = fn

    def call(self, name: str, *args: Any) -> None:
        """Call driver entry point ``name``; raises ``RuntimeError`` on an error code."""
        err = self._fns[name](*args)
        if err != 0:
            raise RuntimeError(f"{name} failed: CUresult {err}")


def _sm_count(resource: Any) -> int:
    return int(struct.unpack_from("I", resource, _SM_COUNT_OFFSET)[0])


class SmPartition:
    """The device's SMs in two disjoint green contexts: ``reserved`` SMs (at least the requested
    number, rounded up by the driver) for the transfer engine, the rest for compute.

    Raises ``OSError`` where the driver has no green contexts and ``RuntimeError`` where the split fails
    (e.g. asking for every SM). :meth:`close` destroys the streams and contexts; work queued on them must
    be finished first.
    """

    def __init__(self, device: torch.device, reserve: int) -> None:
        if reserve < 1:
            raise ValueError(f"reserve: must be >= 1 SM, got {reserve}")
        drv = self._drv = _GreenDriver.get()
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        with torch.cuda.device(index):
            torch.cuda.current_stream().query()  # the primary context exists and is current
        dev = ctypes.c_int()
        drv.call("cuDeviceGet", ctypes.byref(dev), index)
        whole = ctypes.create_string_buffer(_RESOURCE_BYTES)
        drv.call("cuDeviceGetDevResource", dev, whole, CU_DEV_RESOURCE_TYPE_SM)
        group = ctypes.create_string_buffer(_RESOURCE_BYTES)
        rest = ctypes.create_string_buffer(_RESOURCE_BYTES)
        groups = ctypes.c_uint(1)
        drv.call("cuDevSmResourceSplitByCount", group, ctypes.byref(groups), whole, rest, 0, reserve)
        self.total_sms = _sm_count(whole)
        self.reserved_sms = _sm_count(group)
        self.compute_sms = _sm_count(rest)
        if groups.value != 1 or self.reserved_sms < 1 or self.compute_sms < 1:
            raise RuntimeError(f"cannot set {reserve} of {self.total_sms} SMs aside")
        self.device = torch.device("cuda", index)
        self._lock = threading.Lock()
        self._streams: list[int] = []
        self._contexts: list[int] = []
        self._reserved = self._context(dev, group)
        self._compute = self._context(dev, rest)
        self._compute_stream: torch.cuda.ExternalStream | None = None
        self.closed = False

    def _context(self, dev: ctypes.c_int, resource: Any) -> int:
        drv = self._drv
        desc = ctypes.c_void_p()
        drv.call("cuDevResourceGenerateDesc", ctypes.byref(desc), resource, 1)
        ctx = ctypes.c_void_p()
        drv.call("cuGreenCtxCreate", ctypes.byref(ctx), desc, dev, CU_GREEN_CTX_DEFAULT_STREAM)
        assert ctx.value is not None
        self._contexts.append(ctx.value)
        return ctx.value

    def _stream(self, ctx: int, priority: int) -> torch.cuda.ExternalStream:
        if self.closed:
            raise RuntimeError("SM partition is closed")
        s = ctypes.c_void_p()
        self._drv.call("cuGreenCtxStreamCreate", ctypes.byref(s), ctx, CU_STREAM_NON_BLOCKING, priority)
        assert s.value is not None
        with self._lock:
            self._streams.append(s.value)
        return torch.cuda.ExternalStream(s.value, device=self.device)

    def stream(self, priority: int = -1) -> torch.cuda.ExternalStream:
        """A new stream whose kernels run only on the reserved SMs (``RuntimeError`` once closed)."""
        return self._stream(self._reserved, priority)

    def compute_stream(self) -> torch.cuda.ExternalStream:
        """The stream for compute (created once): its kernels run on every SM but the reserved ones.
        Raises ``RuntimeError`` once closed."""
        with self._lock:
            made = self._compute_stream
        if made is None:
            made = self._stream(self._compute, 0)
            with self._lock:
                self._compute_stream = made
        return made

    def close(self) -> None:
        """Destroy the streams and both contexts (idempotent)."""
        with self._lock:
            self.closed = True
            streams, self._streams = self._streams, []
            contexts, self._contexts = self._contexts, []
            self._compute_stream = None
        for s in streams:
            self._drv.call("cuStreamDestroy_v2", s)
        for c in contexts:
            self._drv.call("cuGreenCtxDestroy", c)
