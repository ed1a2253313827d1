"""Prometheus metrics, all named ``hicache_*``.

Each cache owns a :class:`Metrics` with its own ``CollectorRegistry`` (so several caches can live in one
process, e.g. in tests); the service exposes that registry on ``/metrics``. Gauges and the L3 backend's
counters are brought up to date on every cache call and at every scrape (``Metrics.on_collect``), so an
idle node's figures (writeback draining, L3 recovering) are current. ``docs/metrics.md`` lists them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from hicache.accounting import L2_UNSERVED_REASONS
from hicache.accounting import L3_UNSERVED_REASONS as UNSERVED_REASONS

TIERS = ("l1", "l2", "l3")
STORAGE_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
# The L3 backend's counters (:class:`hicache.storage.base.StorageStats` fields) exported as Prometheus
# counters: (field, metric, help).
STORAGE_COUNTERS = (
    ("gets", "hicache_storage_pages_read", "Pages read from L3 and verified"),
    ("get_misses", "hicache_storage_page_misses", "Pages asked of L3 and not returned (absent, damaged, foreign, "
                                                  "or the store down)"),
    ("sets", "hicache_storage_pages_written", "Pages written to L3"),
    ("bytes_read", "hicache_storage_read_bytes", "Bytes of pages read from L3"),
    ("bytes_written", "hicache_storage_written_bytes", "Bytes of pages written to L3"),
    ("stored_bytes_read", "hicache_storage_stored_read_bytes", "Bytes of the pages read from L3 as they were "
                                                               "stored (compressed or not, without frame headers)"),
    ("stored_bytes_written", "hicache_storage_stored_written_bytes", "Bytes of the pages written to L3 as stored "
                                                                     "(written_bytes / this: the compression ratio)"),
    ("corrupt_pages", "hicache_storage_corrupt_pages", "L3 pages that failed frame verification (served as misses)"),
    ("errors", "hicache_storage_errors", "Failed L3 operations (store down, timeout, refused; the file store "
                                         "counts each page)"),
)


class ScrapeHook:
    """A collector with no metrics of its own, registered first: each scrape calls ``fn`` before the
    registry reads the others (gauges and counters brought up to date)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        self.fn()
        return iter(())


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.on_collect: Callable[[], None] | None = None  # set by the owner: refresh gauges at scrape time
        r.register(ScrapeHook(self._collect))  # type: ignore[arg-type]
        self.lookups = Counter("hicache_lookups", "Lookups that open a request: Match calls and peers' ReadPages "
                               "(peeks and peers' WritePages not included; hicache_peeks_total counts peeks)",
                               registry=r)
        self.lookup_tokens = Counter("hicache_lookup_tokens", "Tokens looked up (full pages) by the lookups "
                                     "hicache_lookups_total counts", registry=r)
        self.peeks = Counter("hicache_peeks", "Match calls that only peek (open no request, so nothing is served): "
                             "not in hicache_lookups_total nor in any hit, L2 or L3 figure", registry=r)
        self.hit_tokens = Counter(
            "hicache_hit_tokens", "Prompt tokens served from the cache, by tier (peeks not included): l1 the "
            "prefix Match finds and locks on L1 for the request; l2 the run continuing it on L2, counted when the "
            "request's load back lands it on L1 (what Match found on L2 and was not loaded back is "
            "hicache_l2_unserved_tokens_total); l3 only tokens served from L3 (landed through the request's "
            "prefetch and in its prefix after its load back, counted then; what the store merely reported at "
            "Match is hicache_l3_matched_tokens_total)", ["tier"], registry=r)
        self.l2_unserved_tokens = Counter(
            "hicache_l2_unserved_tokens", "Tokens Match found on L2 (continuing the L1 hit) and not served from it, "
            "by reason: no_room (the request's load back found no room on L1, every page locked by requests in "
            "flight, and no later one landed them), not_loaded (the request was released, or committed its own "
            "pages for them, before loading them back). Once their requests have loaded back, committed or been "
            "released, tokens Match found on L2 are hicache_hit_tokens_total{tier=\"l2\"} plus this",
            ["reason"], registry=r)
        self.l3_matched_tokens = Counter(
            "hicache_l3_matched_tokens", "Tokens the L3 store reported present at Match (continuing the L1 and L2 "
            "hit; peeks not included), served or not. Once their requests have loaded their prefetch back or been "
            "released, this is hicache_hit_tokens_total{tier=\"l3\"} plus hicache_l3_unserved_tokens_total",
            registry=r)
        self.l3_unserved_tokens = Counter(
            "hicache_l3_unserved_tokens", "Tokens matched on L3 and not served from it, by reason: not_fetched (no "
            "prefetch read them: below storage.prefetch_threshold_tokens, over the in-flight cap, no room on L2, "
            "none asked for), missing (the store did not return the page or one before it: absent, "
            "damaged, foreign, store failing), cut_short (the prefetch was stopped first: prefetch_policy's wait, "
            "a release, shutdown), dropped (landed but unused: released before its load back, the request's "
            "tokens changed, the page or its prefix left the cache, no room on L1)", ["reason"], registry=r)
        self.evicted_tokens = Counter("hicache_evicted_tokens", "Tokens evicted, by tier", ["tier"], registry=r)
        self.loadback_tokens = Counter("hicache_loadback_tokens", "Tokens loaded L2 -> L1", registry=r)
        self.loadback_bytes = Counter("hicache_loadback_bytes", "Bytes loaded L2 -> L1", registry=r)
        self.loadback_seconds = Counter("hicache_loadback_seconds", "Seconds in load_back: submitting L2 -> L1 loads "
                                        "and waiting for the request's L3 prefetch (per prefetch_policy); the "
                                        "copies themselves run on after it returns", registry=r)
        self.backup_tokens = Counter("hicache_backed_up_tokens", "Tokens backed up, by destination tier", ["tier"],
                                     registry=r)
        self.backup_skipped_tokens = Counter(
            "hicache_backup_skipped_tokens", "Tokens the write policy would have backed up to L2 but could not: no "
            "L2 page free or evictable (L2 pages pinned, holding requests' prefixes, or waiting for their L3 "
            "write). Such pages are lost when L1 evicts them", registry=r)
        self.prefetch_tokens = Counter("hicache_prefetch_tokens", "Tokens prefetched L3 -> L2 and placed there "
                                       "(pages another request put on L2 meanwhile are not counted again)",
                                       registry=r)
        self.prefetch_aborted = Counter("hicache_prefetch_aborted", "Prefetches not started (in-flight byte cap, no "
                                        "room on L2), cut short (timeout, error), or dropped because the request "
                                        "was released before it loaded them",
                                        registry=r)
        self.writeback_dropped_pages = Counter("hicache_writeback_dropped_pages",
                                               "Pages not written to L3 because the queue was full", registry=r)
        self.writeback_retry_dropped_pages = Counter(
            "hicache_writeback_retry_dropped_pages", "Pages whose L3 write failed and that were given up without "
            "being written: the oldest waiting for a retry, when more failed than the retry queue holds (L2 "
            "keeps them; L3 misses them)", registry=r)
        self.storage = {f: Counter(name, doc, registry=r) for f, name, doc in STORAGE_COUNTERS}
        self.pool_used = Gauge("hicache_pool_used_pages", "Pages in use, by tier", ["tier"], registry=r)
        self.pool_total = Gauge("hicache_pool_total_pages", "Pool capacity in pages, by tier", ["tier"], registry=r)
        self.pinned_pages = Gauge("hicache_pinned_pages", "Pages pinned prefixes hold, by tier (HiCache.pin)",
                                  ["tier"], registry=r)
        self.writeback_queue = Gauge("hicache_writeback_queue_pages", "Pages waiting to be written to L3 "
                                     "(queued, or waiting to retry a write that failed)", registry=r)
        self.tenant_pages = Gauge("hicache_tenant_pages", "Pages a tenant named in cache.tenant_shares holds, by "
                                  "tenant and tier (tenant \"\" shows as a series without the tenant label; tenants "
                                  "only '*' covers are not shown)", ["tenant", "tier"], registry=r)
        self.tenant_share = Gauge("hicache_tenant_share", "The share of each tier (cache.tenant_shares) beyond "
                                  "which a tenant's pages are evicted first, by tenant", ["tenant"], registry=r)
        self.prefetch_inflight_bytes = Gauge("hicache_prefetch_inflight_bytes", "Bytes of L3 prefetches in flight",
                                             registry=r)
        # exported only once a cache with an L3 store asks for it (:meth:`export_storage_up`): without a
        # store there is nothing to probe, and a 0 would read as a store that is down
        self.storage_up = Gauge("hicache_storage_up", "1 when the L3 store answered the node's last probe (a "
                                "round trip every 15 s), 0 when it did not; absent without L3",
                                registry=None)
        self._storage_up_exported = False
        # children bound once: a labels() lookup per call costs microseconds on the hot path
        self.hit = {t: self.hit_tokens.labels(t) for t in TIERS}
        self.l3_unserved = {x: self.l3_unserved_tokens.labels(x) for x in UNSERVED_REASONS}
        self.l2_unserved = {x: self.l2_unserved_tokens.labels(x) for x in L2_UNSERVED_REASONS}
        self.used = {t: self.pool_used.labels(t) for t in TIERS[:2]}
        self.pinned = {t: self.pinned_pages.labels(t) for t in TIERS[:2]}
        self.match_seconds = Histogram("hicache_match_seconds", "Match latency (the lookups "
                                       "hicache_lookups_total counts)", registry=r,
                                       buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1))
        self.storage_op_seconds = Histogram("hicache_storage_op_seconds", "Time of one batched L3 operation, by op "
                                            "(exists at match, get by prefetch, set by writeback)", ["op"],
                                            registry=r, buckets=STORAGE_BUCKETS)
        self.storage_op = {op: self.storage_op_seconds.labels(op) for op in ("exists", "get", "set")}
        self.transfer_submit_seconds = Histogram(
            "hicache_transfer_submit_seconds", "Host time to submit one L1 <-> L2 transfer, by direction (load, "
            "backup); the call returns before the copies end, so time near the copies' own is a host-bound node",
            ["direction"], registry=r, buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1))
        self.transfer_submit = {d: self.transfer_submit_seconds.labels(d) for d in ("load", "backup")}
        self.prefetch_seconds = Histogram("hicache_prefetch_seconds", "From an L3 prefetch's start until its "
                                          "request takes the pages (or gives up, per prefetch_policy)",
                                          registry=r, buckets=STORAGE_BUCKETS)

    def export_storage_up(self) -> None:
        """Put ``hicache_storage_up`` in the registry (a cache with an L3 store calls this; idempotent)."""
        if not self._storage_up_exported:
            self.registry.register(self.storage_up)
            self._storage_up_exported = True

    def _collect(self) -> None:
        if self.on_collect is not None:
            self.on_collect()
