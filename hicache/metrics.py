"""Prometheus metrics, all named ``hicache_*``.

Each cache owns a :class:`Metrics` with its own ``CollectorRegistry`` (so several caches can live in one
process, e.g. in tests); the service exposes that registry on ``/metrics``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TIERS = ("l1", "l2", "l3")


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.lookups = Counter("hicache_lookups", "Match calls", registry=r)
        self.lookup_tokens = Counter("hicache_lookup_tokens", "Tokens looked up (full pages)", registry=r)
        self.hit_tokens = Counter("hicache_hit_tokens", "Tokens hit, by tier", ["tier"], registry=r)
        self.evicted_tokens = Counter("hicache_evicted_tokens", "Tokens evicted, by tier", ["tier"], registry=r)
        self.loadback_tokens = Counter("hicache_loadback_tokens", "Tokens loaded L2 -> L1", registry=r)
        self.loadback_bytes = Counter("hicache_loadback_bytes", "Bytes loaded L2 -> L1", registry=r)
        self.loadback_seconds = Counter("hicache_loadback_seconds", "Seconds spent issuing/awaiting L2 -> L1 loads",
                                        registry=r)
        self.backup_tokens = Counter("hicache_backed_up_tokens", "Tokens backed up, by destination tier", ["tier"],
                                     registry=r)
        self.prefetch_tokens = Counter("hicache_prefetch_tokens", "Tokens prefetched L3 -> L2", registry=r)
        self.prefetch_aborted = Counter("hicache_prefetch_aborted", "Prefetches cut short (timeout, cancel, error)",
                                        registry=r)
        self.writeback_dropped_pages = Counter("hicache_writeback_dropped_pages",
                                               "Pages not written to L3 because the queue was full", registry=r)
        self.storage_errors = Counter("hicache_storage_errors", "Failed L3 operations", registry=r)
        self.storage_corrupt_pages = Counter("hicache_storage_corrupt_pages",
                                             "L3 pages that failed frame verification (served as misses)", registry=r)
        self.pool_used = Gauge("hicache_pool_used_pages", "Pages in use, by tier", ["tier"], registry=r)
        self.pool_total = Gauge("hicache_pool_total_pages", "Pool capacity in pages, by tier", ["tier"], registry=r)
        self.writeback_queue = Gauge("hicache_writeback_queue_pages", "Pages waiting to be written to L3",
                                     registry=r)
        self.prefetch_inflight_bytes = Gauge("hicache_prefetch_inflight_bytes", "Bytes of L3 prefetches in flight",
                                             registry=r)
        # children bound once: a labels() lookup per call costs microseconds on the hot path
        self.hit = {t: self.hit_tokens.labels(t) for t in TIERS}
        self.used = {t: self.pool_used.labels(t) for t in TIERS[:2]}
        self.match_seconds = Histogram("hicache_match_seconds", "Match latency", registry=r,
                                       buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1))
