"""The L1 pool in memory another process on this host can map: zero KV copies through gRPC.

* CPU: a POSIX shared memory segment (``multiprocessing.shared_memory``) viewed with ``torch.frombuffer``.
* CUDA: one ``torch.empty`` allocation exported with CUDA IPC (``torch.multiprocessing.reductions``); the
  handle's fields travel in :class:`CudaIpcHandle` and the client rebuilds the tensor with
  ``rebuild_cuda_tensor`` (no pickle crosses the wire).

Either way the memory is one flat uint8 buffer viewed as ``[L, C, P, S, H, D]`` (layer-first, like
:class:`hicache.pool.DevicePool`), so ``kv[layer][c][page]`` is the same bytes in every process.
:func:`hicache.client.attach.attach_pool` is the other side.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from multiprocessing import shared_memory

import torch

from hicache.layout import KVLayout
from hicache.pool import DevicePool, reserve_host_memory
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb

log = logging.getLogger("hicache.service")


class SharedPool:
    """Owns the memory behind a shared L1 pool; ``fill(info)`` writes its handle into a PoolInfo."""

    def __init__(self, layout: KVLayout, num_pages: int, device: str) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.nbytes = num_pages * layout.bytes_per_page
        self._shm: shared_memory.SharedMemory | None = None
        self._cuda_buf: torch.Tensor | None = None
        dev = torch.device(device)
        if dev.type == "cuda":
            buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=dev)
            self._cuda_buf = buf
            self.kind = "cuda_ipc"
        else:
            name = f"hicache-{os.getpid()}-{secrets.token_hex(4)}"
            # a new segment reads as zeros and takes memory only as its pages are written: no fill here
            # (zeroing 8 GiB page by page took 15 s of start-up), and counted as host memory still to come
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=self.nbytes)
            reserve_host_memory(self._shm, self.nbytes)
            buf = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=self.nbytes)
            self.kind = "shm"
        self.pool = DevicePool.from_buffer(layout, num_pages, buf)

    @property
    def name(self) -> str:
        return self._shm.name if self._shm is not None else ""

    def fill(self, info: pb.PoolInfo) -> None:
        if self._shm is not None:
            info.shm.name = self._shm.name
            info.shm.size_bytes = self.nbytes
            return
        assert self._cuda_buf is not None
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self._cuda_buf)
        (_, _, _, _, _, _, device, handle, storage_size, storage_offset, _, ref_handle, ref_offset,
         event_handle, event_sync) = args
        h = info.cuda_ipc
        h.device = int(device)
        h.handle = bytes(handle)
        h.storage_size_bytes = int(storage_size)
        h.storage_offset_bytes = int(storage_offset)
        h.ref_counter_handle = bytes(ref_handle)
        h.ref_counter_offset = int(ref_offset)
        h.event_handle = bytes(event_handle) if event_handle else b""
        h.event_sync_required = bool(event_sync)
        h.size_bytes = self.nbytes

    def close(self) -> None:
        """Unlink the segment (processes that mapped it keep their mapping until they close it)."""
        if self._shm is not None:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
            try:
                self._shm.close()
            except BufferError:  # tensors still view it; the mapping goes with the process
                log.debug("shared pool %s: views still alive at close", self._shm.name)
            self._shm = None
