"""Map the server's shared L1 pool into this process: KV pages read and written in place, no copies.

    info = client.attach_info()            # the Attach RPC: layout + handle
    with attach_pool(info) as shared:      # or client.attach()
        k = shared.pool.kv[layer][0]       # [P, S, H, D] view of layer's K over every L1 page
        k[page].copy_(...)                 # write a page the server allocated to your request

CPU: the POSIX shared memory segment the server created (same host only). CUDA: the server's allocation
rebuilt from its CUDA IPC handle (same host, a CUDA build of torch, the same GPU visible). "Same host" is
the same kernel (:mod:`hicache.service.hostid`), so containers and pods of one machine qualify whatever their
hostnames; they still need to see the node's ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import socket
from multiprocessing import resource_tracker, shared_memory
from types import TracebackType
from typing import TYPE_CHECKING

from hicache.client.types import PoolInfo
from hicache.layout import KVLayout
from hicache.service.hostid import host_id

if TYPE_CHECKING:  # torch is imported by attach_pool only: a client that never attaches does without it
    import torch

    from hicache.pool import DevicePool


class AttachedPool:
    """The server's L1 pool as a :class:`DevicePool` in this process (its allocator is unused here:
    pages come from the server's Allocate)."""

    def __init__(self, info: PoolInfo, pool: DevicePool, shm: shared_memory.SharedMemory | None) -> None:
        self.info = info
        self.pool = pool
        self._shm = shm

    @property
    def layout(self) -> KVLayout:
        return self.info.layout

    def page(self, layer: int, c: int, page: int) -> torch.Tensor:
        """``[S, H, D]`` view of one page of one layer's K (c=0) / V (c=1)."""
        return self.pool.kv[layer][c][page]

    def close(self) -> None:
        """Drop the mapping (tensors viewing it must not be used afterwards)."""
        self.pool.kv = []
        self.pool.buffer = None
        if self._shm is not None:
            shm, self._shm = self._shm, None
            with contextlib.suppress(BufferError):  # a caller still holds a view: it goes with the process
                shm.close()

    def __enter__(self) -> AttachedPool:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def attach_pool(info: PoolInfo) -> AttachedPool:
    """Map the pool described by an Attach reply. ``ValueError`` when it cannot be mapped from here."""
    import torch

    from hicache.pool import DevicePool

    m = info.raw
    kind = m.WhichOneof("handle")
    if kind is None:
        raise ValueError("attach: the reply carries no pool handle (GetPoolInfo, or the pool is not shared)")
    here = host_id()
    if m.host_id and here:  # the same machine whatever the containers' hostnames
        if m.host_id != here:
            raise ValueError(f"attach: the pool lives on another machine (host {m.hostname!r}, boot id "
                             f"{m.host_id}, this is {here}); use ReadPages / WritePages from another host")
    elif m.hostname and m.hostname != socket.gethostname():
        raise ValueError(f"attach: the pool lives on host {m.hostname!r}, this is {socket.gethostname()!r}; "
                         "use ReadPages / WritePages from another host")
    need = info.num_pages * info.layout.bytes_per_page
    if kind == "shm":
        try:
            shm = shared_memory.SharedMemory(name=m.shm.name)
        except FileNotFoundError:
            raise ValueError(f"attach: shared memory segment {m.shm.name!r} not found (server on another "
                             "host or container without a shared /dev/shm?)") from None
        # Python 3.11 registers attached segments with the resource tracker, which would unlink the
        # server's segment when this process exits: the server owns it, so unregister.
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        if shm.size < need:
            shm.close()
            raise ValueError(f"attach: segment has {shm.size} bytes, the pool needs {need}")
        buf = torch.frombuffer(shm.buf, dtype=torch.uint8, count=need)
        return AttachedPool(info, DevicePool.from_buffer(info.layout, info.num_pages, buf), shm)
    h = m.cuda_ipc
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    buf = rebuild_cuda_tensor(torch.Tensor, torch.Size([h.size_bytes]), (1,), 0, torch.storage.TypedStorage,
                              torch.uint8, h.device, h.handle, h.storage_size_bytes, h.storage_offset_bytes, False,
                              h.ref_counter_handle, h.ref_counter_offset, h.event_handle or None,
                              h.event_sync_required)
    if buf.numel() < need:
        raise ValueError(f"attach: CUDA buffer has {buf.numel()} bytes, the pool needs {need}")
    return AttachedPool(info, DevicePool.from_buffer(info.layout, info.num_pages, buf[:need]), None)
