"""Stream memory waits through the CUDA driver API (``cuStreamWaitValue32``), via ctypes.

``wait_geq(stream, address, value)`` enqueues on ``stream`` a wait until the 32-bit word at device
``address`` is >= ``value``; the host does not block. The transfer engine uses it for per-layer readiness
of a load that runs as one kernel launch (the kernel publishes a flag per layer).
"""

from __future__ import annotations

import ctypes
import threading

CU_STREAM_WAIT_VALUE_GEQ = 0x0


class StreamWaiter:
    """Driver entry points for stream memory waits; raises ``OSError`` when unavailable."""

    _instance: StreamWaiter | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = getattr(lib, "cuStreamWaitValue32_v2", None) or getattr(lib, "cuStreamWaitValue32", None)
        if fn is None:
            raise OSError("cuStreamWaitValue32 not in libcuda")
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._wait = fn
        lib.cuCtxGetCurrent.restype = ctypes.c_int
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxSetCurrent.restype = ctypes.c_int
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        self._lib = lib

    @classmethod
    def get(cls) -> StreamWaiter:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def current_context(self) -> int:
        ctx = ctypes.c_void_p(0)
        err = self._lib.cuCtxGetCurrent(ctypes.byref(ctx))
        if err != 0:
            raise RuntimeError(f"cuCtxGetCurrent failed: {err}")
        return int(ctx.value or 0)

    def wait_geq(self, stream: int, address: int, value: int, context: int) -> None:
        """Make ``stream`` wait until ``*(uint32*)address >= value``; ``context`` made current if none is."""
        if context and self.current_context() == 0:
            err = self._lib.cuCtxSetCurrent(context)
            if err != 0:
                raise RuntimeError(f"cuCtxSetCurrent failed: {err}")
        err = self._wait(stream, address, value, CU_STREAM_WAIT_VALUE_GEQ)
        if err != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed: CUresult {err}")
