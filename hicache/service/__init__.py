"""The node service: ``hicache serve`` speaks gRPC (``proto/hicache/v1/hicache.proto``) beside an engine.

* :mod:`.server`       -- builds and runs the grpc.aio server (uvloop, TLS/mTLS, auth, health, reflection,
  bounded concurrency, graceful SIGTERM with an L3 flush).
* :mod:`.servicer`     -- the RPC handlers over one :class:`hicache.cache.HiCache`, composed of
  :mod:`.request_rpcs` (Match .. Release), :mod:`.node_rpcs` (Stats, Flush, pins, Clear, WatchEvents,
  GetPoolInfo, Attach) and :mod:`.page_rpcs` (ReadPages, WritePages) over :mod:`.servicer_base`.
* :mod:`.rpc`          -- status mapping, the concurrency bound and timing around every handler.
* :mod:`.validation`   -- request checks: every rejected call is refused before the cache is touched.
* :mod:`.decode`       -- a request whose bytes do not decode gets INVALID_ARGUMENT, not UNKNOWN.
* :mod:`.pages`        -- L1 pages <-> canonical page bytes for peers on other hosts.
* :mod:`.requests`     -- open requests by client-chosen id (ownership of locks and pages, idle expiry).
* :mod:`.events`       -- the event hub behind WatchEvents (gap-free sequence numbers, snapshots).
* :mod:`.shared_pool`  -- the L1 pool in shared memory (CPU) or CUDA IPC-exportable memory (GPU).
* :mod:`.auth`         -- bearer tokens checked before any request is read; tokens mapped to tenants.
* :mod:`.metrics_http` -- RPC metrics and the Prometheus ``/metrics`` HTTP endpoint.
* :mod:`.cli`          -- ``hicache serve --config FILE`` (flags override the file).
"""
