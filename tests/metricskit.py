"""Ground truth for the metrics tests: every ``hicache_*`` sample of a registry or a ``/metrics`` page,
compared step by step with what a scenario says it must be, and an L3 store that stalls on cue.

A plain module (not a conftest) so every test package imports the same one.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from hicache.cache import HiCache
from hicache.config import HiCacheConfig
from hicache.pool import HostPool
from hicache.storage.base import StorageContext
from hicache.storage.memory import MemoryBackend

# One sample: (name as scraped, sorted label pairs).
Key = tuple[str, tuple[tuple[str, str], ...]]
GATE_TIMEOUT_S = 20.0  # a stalled store call never waits longer than this (a broken test must not hang)


def key(name: str, **labels: str) -> Key:
    return name, tuple(sorted(labels.items()))


def _keep(name: str) -> bool:
    """Counters and gauges; histograms and time-valued counters are timing, not bookkeeping."""
    return (name.startswith("hicache_") and not name.endswith("_created") and "seconds" not in name)


def samples(registry: CollectorRegistry) -> dict[Key, float]:
    """Every hicache_* counter and gauge sample of ``registry`` (a collect runs the scrape hooks first,
    as a real scrape does)."""
    return {key(s.name, **s.labels): s.value for fam in registry.collect() for s in fam.samples if _keep(s.name)}


def parse(text: str) -> dict[Key, float]:
    """The same from a ``/metrics`` page (Prometheus text format)."""
    return {key(s.name, **s.labels): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if _keep(s.name) or s.name.startswith("hicache_rpc_seconds")}


def scrape(port: int, host: str = "127.0.0.1") -> dict[Key, float]:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        return parse(r.read().decode())


def diff(before: Mapping[Key, float], after: Mapping[Key, float]) -> dict[Key, float]:
    """What changed, sample by sample (a sample absent on one side counts as 0 there)."""
    out = {}
    for k in set(before) | set(after):
        d = after.get(k, 0.0) - before.get(k, 0.0)
        if d:
            out[k] = d
    return out


def fmt(d: Mapping[Key, float]) -> str:
    return "\n".join(f"  {n}{dict(lab) if lab else ''} = {v:g}" for (n, lab), v in sorted(d.items()))


class Ledger:
    """Checks a cache's metrics step by step: :meth:`step` asserts that the counters moved by exactly the
    expected amounts (every other counter stayed put) and that the gauges read exactly the expected values
    (every other gauge kept its value)."""

    GAUGES = ("hicache_pool_used_pages", "hicache_pool_total_pages", "hicache_pinned_pages",
              "hicache_writeback_queue_pages", "hicache_prefetch_inflight_bytes", "hicache_storage_up")

    def __init__(self, cache: HiCache) -> None:
        self.cache = cache
        self.last = samples(cache.metrics.registry)

    def step(self, what: str, counters: Mapping[Key, float] | None = None,
             gauges: Mapping[Key, float] | None = None) -> None:
        now = samples(self.cache.metrics.registry)
        got_c = {k: v for k, v in diff(self.last, now).items() if k[0] not in self.GAUGES}
        want_c = {k: float(v) for k, v in (counters or {}).items() if v}
        got_g = {k: now.get(k, 0.0) for k in now if k[0] in self.GAUGES}
        want_g = {k: self.last.get(k, 0.0) for k in self.last if k[0] in self.GAUGES}
        want_g.update({k: float(v) for k, v in (gauges or {}).items()})
        problems = []
        if got_c != want_c:
            problems.append(f"counters moved by\n{fmt(got_c)}\nexpected\n{fmt(want_c)}")
        if got_g != want_g:
            problems.append(f"gauges read\n{fmt(got_g)}\nexpected\n{fmt(want_g)}")
        assert not problems, f"{what}:\n" + "\n".join(problems)
        self.last = now


# --- shorthand for the keys a scenario names ----------------------------------------------------------
def lookups(n: int, tokens: int) -> dict[Key, float]:
    return {key("hicache_lookups_total"): n, key("hicache_lookup_tokens_total"): tokens}


def hits(l1: int = 0, l2: int = 0, l3: int = 0) -> dict[Key, float]:
    return {key("hicache_hit_tokens_total", tier=t): v for t, v in (("l1", l1), ("l2", l2), ("l3", l3))}


def l3_run(matched: int = 0, **unserved: int) -> dict[Key, float]:
    """Tokens Match found on L3 (``hicache_l3_matched_tokens_total``) and, by reason, tokens of such runs
    not served from L3 (``hicache_l3_unserved_tokens_total``; reasons as :class:`hicache.accounting.L3Tally`)."""
    out = {key("hicache_l3_matched_tokens_total"): float(matched)}
    out.update({key("hicache_l3_unserved_tokens_total", reason=r): float(v) for r, v in unserved.items()})
    return out


def l2_unserved(**reasons: int) -> dict[Key, float]:
    """Tokens Match found on L2 and not served from it, by reason (``hicache_l2_unserved_tokens_total``;
    reasons as :class:`hicache.accounting.L2Tally`)."""
    return {key("hicache_l2_unserved_tokens_total", reason=r): float(v) for r, v in reasons.items()}


def evicted(l1: int = 0, l2: int = 0) -> dict[Key, float]:
    return {key("hicache_evicted_tokens_total", tier="l1"): l1, key("hicache_evicted_tokens_total", tier="l2"): l2}


def backed(l2: int = 0, l3: int = 0) -> dict[Key, float]:
    return {key("hicache_backed_up_tokens_total", tier="l2"): l2,
            key("hicache_backed_up_tokens_total", tier="l3"): l3}


def loadback(tokens: int, bytes_: int) -> dict[Key, float]:
    return {key("hicache_loadback_tokens_total"): tokens, key("hicache_loadback_bytes_total"): bytes_}


def storage(read: int = 0, misses: int = 0, written: int = 0, corrupt: int = 0, errors: int = 0,
            page_bytes: int = 0) -> dict[Key, float]:
    """The L3 counters (pages stored as they are: no ``storage.compression``)."""
    return {key("hicache_storage_pages_read_total"): read, key("hicache_storage_page_misses_total"): misses,
            key("hicache_storage_pages_written_total"): written,
            key("hicache_storage_read_bytes_total"): read * page_bytes,
            key("hicache_storage_written_bytes_total"): written * page_bytes,
            key("hicache_storage_stored_read_bytes_total"): read * page_bytes,
            key("hicache_storage_stored_written_bytes_total"): written * page_bytes,
            key("hicache_storage_corrupt_pages_total"): corrupt, key("hicache_storage_errors_total"): errors}


def pools(l1: int, l2: int) -> dict[Key, float]:
    return {key("hicache_pool_used_pages", tier="l1"): l1, key("hicache_pool_used_pages", tier="l2"): l2}


def merge(*parts: Mapping[Key, float]) -> dict[Key, float]:
    out: dict[Key, float] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0.0) + v
    return out


# --- a store that stalls on cue ---------------------------------------------------------------------
class StallingStore(MemoryBackend):
    """``memory://`` whose reads or writes stop on cue and wait for :meth:`go`.

    ``stall_reads_after(n)``: the next ``n`` pages read as usual; the read after them waits for ``go()``
    and then, with ``fail=True``, returns nothing and counts one error (a store that timed out), else
    reads as usual. ``stall_writes()``: every ``batch_set`` waits for ``go()``. ``stalled`` is set
    while a call waits.
    """

    def __init__(self, url: str, ctx: StorageContext, **options: Any) -> None:
        super().__init__(url, ctx, **options)
        self._reads_left: int | None = None
        self._fail = False
        self._stall_writes = False
        self._gate = threading.Event()
        self.stalled = threading.Event()

    def stall_reads_after(self, n: int, fail: bool) -> None:
        self._reads_left, self._fail = n, fail
        self._gate.clear()
        self.stalled.clear()

    def stall_writes(self) -> None:
        self._stall_writes = True
        self._gate.clear()
        self.stalled.clear()

    def go(self) -> None:
        self._reads_left, self._stall_writes = None, False
        self._gate.set()

    def _wait(self) -> None:
        self.stalled.set()
        if not self._gate.wait(GATE_TIMEOUT_S):
            raise AssertionError("StallingStore: nobody called go()")

    def batch_get(self, keys: Sequence[bytes], host_pool: HostPool, host_indices: Sequence[int]) -> int:
        left = self._reads_left
        if left is not None:
            if left <= 0:
                fail = self._fail
                self._wait()
                if fail:
                    self._count(errors=1, get_misses=len(keys))
                    return 0
            else:
                if len(keys) > left:
                    raise AssertionError("StallingStore: use io_batch_pages=1 with stall_reads_after")
                self._reads_left = left - len(keys)
        return super().batch_get(keys, host_pool, host_indices)

    def batch_set(self, keys: Sequence[bytes], host_pool: HostPool, host_indices: Sequence[int]) -> int:
        if self._stall_writes:
            self._wait()
        return super().batch_set(keys, host_pool, host_indices)


def stalling_cache(config: HiCacheConfig) -> tuple[HiCache, StallingStore]:
    """A cache over a :class:`StallingStore` built for ``config``'s namespace and layout."""
    ns = config.namespace()
    ctx = StorageContext(ns.digest, config.layout.to_layout(), ns.model, ns.tp_rank, ns.tp_size,
                         config.cache.host_layout)
    store = StallingStore("memory://", ctx)
    return HiCache(config, storage=store), store
