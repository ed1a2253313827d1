"""The cache port over the node service: :class:`GrpcCachePort` wraps :class:`hicache.client.HiCacheClient`.

The model computes in the server's L1 pool, mapped into this process (shared memory on CPU, CUDA IPC on a
GPU; same host), so gRPC carries token ids and page indices only::

    with HiCacheClient("127.0.0.1:50051") as client:
        port = GrpcCachePort(client)                 # attaches the pool
        node = ServingNode(model, port)

Loads happen in the server: ``load_back`` runs the Prefetch call (L3 -> L2 -> L1), whose last message
arrives once the pages are on L1, so ``wait_layer`` has nothing left to wait for (no per-layer overlap
across the process boundary). ``ns`` in :meth:`match` is a tenant name (or a Namespace, whose tenant is
used). Needs the ``grpc`` client stack; importing this module without it raises ``ImportError``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.client import AttachedPool, HiCacheClient
from hicache.pool import DevicePool

_ids = itertools.count()


@dataclass
class RemoteRequest:
    request_id: str
    l1_pages: int
    l2_pages: int
    l3_pages: int
    device_indices: np.ndarray  # L1 prefix pages (after load_back: loaded; after commit: committed)


@dataclass
class RemoteLoad:
    device_indices: np.ndarray
    l2_pages: int
    l3_pages: int

    def wait_layer(self, layer: int) -> None:
        return None  # the server finished the load before answering


class GrpcCachePort:
    """:class:`~hicache.engine.port.CachePort` through the node service's blocking client."""

    def __init__(self, client: HiCacheClient, attached: AttachedPool | None = None) -> None:
        self.client = client
        self.attached = attached or client.attach()
        self.device_pool: DevicePool = self.attached.pool
        self.page_size = self.attached.layout.page_size
        self._prefix = f"node-{os.getpid()}-{id(self):x}-"

    def match(self, tokens: Sequence[int] | np.ndarray, ns: Any = None) -> RemoteRequest:
        tenant = ns if isinstance(ns, str) else getattr(ns, "tenant", "") or ""
        m = self.client.match(tokens, f"{self._prefix}{next(_ids)}", tenant=tenant)
        return RemoteRequest(m.request_id, m.l1_pages, m.l2_pages, m.l3_pages, m.device_indices)

    def prefetch(self, req: RemoteRequest) -> int:
        return 0  # the server prefetches L3 -> L2 inside load_back's Prefetch call

    def load_back(self, req: RemoteRequest) -> RemoteLoad:
        last = None
        for progress in self.client.prefetch(req.request_id):
            last = progress
        if last is None or not last.done:
            raise RuntimeError(f"prefetch of {req.request_id}: the stream ended before the load finished")
        req.device_indices = last.device_indices
        return RemoteLoad(last.device_indices, last.loaded_l2_pages, last.loaded_l3_pages)

    def alloc(self, req: RemoteRequest, n_pages: int) -> np.ndarray:
        return self.client.allocate(req.request_id, n_pages) if n_pages else np.zeros(0, dtype=np.int64)

    def commit(self, req: RemoteRequest, tokens: Sequence[int] | np.ndarray, device_pages: np.ndarray) -> Any:
        res = self.client.commit(req.request_id, tokens, device_pages)
        req.device_indices = res.device_indices
        return res

    def release(self, req: RemoteRequest) -> None:
        self.client.release(req.request_id)

    def close(self) -> None:
        self.attached.close()
