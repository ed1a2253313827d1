"""The cache port: the few calls a serving node makes on a KV cache, whichever side of a process boundary
the cache lives on.

:class:`~hicache.cache.HiCache` satisfies :class:`CachePort` in-process as it is; :class:`NoCachePort` is
the baseline that never hits (same pool, same allocation path, nothing kept);
:class:`~hicache.engine.grpc_port.GrpcCachePort` wraps the node-service client when it is installed.
The node has one code path for all of them::

    req = port.match(tokens)                     # .device_indices, .l1_pages, .l2_pages, .l3_pages
    port.prefetch(req)
    load = port.load_back(req)                   # .device_indices; .wait_layer(i)
    pages = port.alloc(req, n)
    port.commit(req, tokens, pages)              # tokens: whole sequence; pages: its full pages' L1 pages
    port.release(req)

``port.device_pool.kv[layer][c]`` is the L1 pool the model reads and writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from hicache.cache import CacheFullError
from hicache.layout import KVLayout
from hicache.pool import DevicePool

_EMPTY = np.zeros(0, dtype=np.int64)


class CacheLoad(Protocol):
    device_indices: np.ndarray  # L1 pages of the whole usable prefix, in order

    def wait_layer(self, layer: int) -> None: ...


@runtime_checkable
class CachePort(Protocol):
    """What the serving node needs from a KV cache (see the module docstring for the call order)."""

    page_size: int
    device_pool: DevicePool

    def match(self, tokens: Sequence[int] | np.ndarray, ns: Any = None) -> Any: ...

    def prefetch(self, req: Any) -> int: ...

    def load_back(self, req: Any) -> Any: ...

    def alloc(self, req: Any, n_pages: int) -> np.ndarray: ...

    def commit(self, req: Any, tokens: Sequence[int] | np.ndarray, device_pages: np.ndarray) -> Any: ...

    def release(self, req: Any) -> None: ...


@dataclass
class _NoCacheRequest:
    device_indices: np.ndarray = field(default_factory=lambda: _EMPTY)
    l1_pages: int = 0
    l2_pages: int = 0
    l3_pages: int = 0
    owned: list[np.ndarray] = field(default_factory=list)
    released: bool = False


@dataclass
class _NoLoad:
    device_indices: np.ndarray

    def wait_layer(self, layer: int) -> None:
        return None


class NoCachePort:
    """Baseline: every request recomputes its whole prompt; pages go back to the pool at release."""

    def __init__(self, layout: KVLayout, num_pages: int, device: str = "cpu") -> None:
        self.page_size = layout.page_size
        self.device_pool = DevicePool(layout, num_pages, device)

    def match(self, tokens: Sequence[int] | np.ndarray, ns: Any = None) -> _NoCacheRequest:
        return _NoCacheRequest()

    def prefetch(self, req: _NoCacheRequest) -> int:
        return 0

    def load_back(self, req: _NoCacheRequest) -> _NoLoad:
        return _NoLoad(_EMPTY)

    def alloc(self, req: _NoCacheRequest, n_pages: int) -> np.ndarray:
        pages = self.device_pool.allocator.alloc(n_pages)
        if pages is None:
            raise CacheFullError(f"L1: need {n_pages} pages, {self.device_pool.allocator.free_pages} free")
        req.owned.append(pages)
        return pages

    def commit(self, req: _NoCacheRequest, tokens: Sequence[int] | np.ndarray, device_pages: np.ndarray) -> None:
        return None

    def release(self, req: _NoCacheRequest) -> None:
        if req.released:
            raise ValueError("release: request already released")
        for p in req.owned:
            self.device_pool.allocator.free(p)
        req.owned, req.released = [], True
