"""Clients of the node service (``hicache serve``).

* :class:`HiCacheClient` (blocking) and :class:`AsyncHiCacheClient` (asyncio): typed results, a default
  deadline on every call, retries with backoff on UNAVAILABLE where a repeat is safe (:class:`RetryPolicy`),
  bearer token and TLS/mTLS options.
* :func:`attach_pool` / ``client.attach()``: map the server's shared L1 pool (shared memory on CPU, CUDA
  IPC on GPU) so KV pages are read and written in place; gRPC only carries token ids and page indices.
"""

from hicache.client._common import CallError, RetryPolicy
from hicache.client.aio import AsyncHiCacheClient, AsyncMatchStream
from hicache.client.attach import AttachedPool, attach_pool
from hicache.client.sync import HiCacheClient, MatchStream
from hicache.client.types import (
    ClearResult,
    CommitResult,
    Event,
    FlushResult,
    MatchResult,
    PageRun,
    PinInfo,
    PoolInfo,
    PrefetchProgress,
    Stats,
)

__all__ = [
    "AsyncHiCacheClient",
    "AsyncMatchStream",
    "AttachedPool",
    "CallError",
    "ClearResult",
    "CommitResult",
    "Event",
    "FlushResult",
    "HiCacheClient",
    "MatchResult",
    "MatchStream",
    "PageRun",
    "PinInfo",
    "PoolInfo",
    "PrefetchProgress",
    "RetryPolicy",
    "Stats",
    "attach_pool",
]
