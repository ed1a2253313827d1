"""One engine process's view of a hicache L3 store: what the SGLang and vLLM adapters share.

An inference engine (SGLang, vLLM) hands over pages it keeps in its own host memory, named by its own
page hashes, which carry neither model, dtype, layout nor TP shard. :class:`EngineStore` makes them
hicache pages:

* **Namespace.** ``EnginePages`` (model, weights revision, KV layout, the engine's byte order of a page,
  TP / PP shard) and the tenant from the configuration form a :class:`hicache.keys.Namespace`. The key a
  page is stored under is ``sha256(namespace digest || engine key)``, so two models, layouts, shards or
  tenants never share (or overwrite) a page, and every frame carries the namespace digest as well, checked
  on read. The same model and layout on another process or host computes the same keys: it hits.
* **Framing.** Pages go through hicache's own backends (Redis single / Sentinel / Cluster / TLS, file
  stores over pyarrow.fs), framed and verified like every L3 page: a damaged or foreign page is a miss,
  counted in ``hicache_storage_corrupt_pages_total``, never a wrong page.
* **Zero copy.** A page is a list of byte views into the engine's memory (its K and V, or its layers, may
  lie apart); backends write and read those pieces in place (:class:`EngineBuffers`).
* **Never raises for the store.** A store that is down or slow is a miss / nothing written, counted in
  ``hicache_storage_errors_total``; the engine recomputes. Only bad configuration and caller bugs raise.

Configuration (the JSON an engine passes through; :func:`parse_config`): ``url`` (required), ``tenant``,
``revision``, ``compression``, ``compression_level``, ``io_batch_pages``, ``options`` (the backend's own:
Redis timeouts, TTL, prefix, TLS files; the file store's size cap), ``metrics`` (``HOST:PORT`` of a
Prometheus endpoint for the ``hicache_storage_*`` counters, ``""`` for none). Unknown fields and bad values
raise :class:`hicache.config.ConfigError` with one line naming the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from prometheus_client import CollectorRegistry

from hicache.config import ConfigError, StorageConfig
from hicache.keys import Namespace
from hicache.layout import KVLayout
from hicache.metrics import STORAGE_COUNTERS
from hicache.storage import StorageBackend, StorageContext, create_backend
from hicache.storage.base import safe_url
from hicache.storage.frame import PageBuf
from hicache.storage.pageio import PageBuffers

log = logging.getLogger(__name__)

# the storage section's fields an engine may set (the prefetch / writeback queues are the engine's own)
_STORAGE_FIELDS = ("url", "compression", "compression_level", "io_batch_pages", "options")
CONFIG_FIELDS = (*_STORAGE_FIELDS, "tenant", "revision", "metrics")
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


@dataclass(frozen=True)
class EngineConfig:
    """hicache's part of an engine's storage configuration, validated."""

    storage: StorageConfig  # url, compression, io batch, backend options
    tenant: str = ""  # tenant salt: tenants sharing a store never share a page
    revision: str = ""  # weights revision; "" derives one from a local model directory (see model_revision)
    metrics: str = ""  # HOST:PORT for a Prometheus endpoint of this process's hicache_storage_* counters


def parse_config(raw: Mapping[str, Any], where: str) -> EngineConfig:
    """``raw`` (hicache's fields of an engine's JSON) -> :class:`EngineConfig`; ``ConfigError`` names the
    field as ``WHERE: FIELD: problem``."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: must be a JSON object, got {type(raw).__name__}", where)
    unknown = sorted(set(raw) - set(CONFIG_FIELDS))
    if unknown:
        raise ConfigError(f"{where}: {unknown[0]}: unknown field; known: {sorted(CONFIG_FIELDS)}", where)
    if not raw.get("url"):
        raise ConfigError(f"{where}: url: required (redis://HOST:6379/0, redis+cluster://HOST:7000, "
                          "file:///shared/dir, s3://bucket/prefix, ...)", f"{where}.url")
    for name in ("url", "tenant", "revision", "metrics", "compression"):
        if name in raw and not isinstance(raw[name], str):
            raise ConfigError(f"{where}: {name}: must be a string, got {raw[name]!r}", f"{where}.{name}")
    for name in ("io_batch_pages", "compression_level"):
        if name in raw and (not isinstance(raw[name], int) or isinstance(raw[name], bool)):
            raise ConfigError(f"{where}: {name}: must be an integer, got {raw[name]!r}", f"{where}.{name}")
    if "options" in raw and not isinstance(raw["options"], Mapping):
        raise ConfigError(f"{where}: options: must be a JSON object, got {raw['options']!r}", f"{where}.options")
    try:
        storage = StorageConfig(**{k: raw[k] for k in _STORAGE_FIELDS if k in raw})
    except ConfigError as e:
        field = e.field.removeprefix("storage.")
        raise ConfigError(f"{where}: {str(e).removeprefix('storage.')}", f"{where}.{field}") from None
    metrics = str(raw.get("metrics", ""))
    if metrics:
        host, sep, port = metrics.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{where}: metrics: must be HOST:PORT (e.g. 127.0.0.1:9410), got {metrics!r}",
                              f"{where}.metrics")
    return EngineConfig(storage, str(raw.get("tenant", "")), str(raw.get("revision", "")), metrics)


def model_revision(model: str) -> str:
    """A weights revision for ``model`` when none is configured: for a local model directory, a digest of
    its ``config.json`` and of its weight files' names and sizes (so ``/models`` holding other weights is
    another namespace); else ``"main"`` (a hub id: set ``revision`` to pin it)."""
    d = Path(model)
    try:
        if not d.is_dir():
            return "main"
        h = hashlib.sha256()
        cfg = d / "config.json"
        if cfg.is_file():
            h.update(cfg.read_bytes())
        for pattern in _WEIGHT_GLOBS:
            for f in sorted(d.glob(pattern)):
                h.update(f"{f.name}:{f.stat().st_size}\n".encode())
        return "local-" + h.hexdigest()[:16]
    except OSError:
        return "main"


@dataclass(frozen=True)
class EnginePages:
    """What an engine says about the pages it hands over: one TP / PP shard of one model."""

    engine: str  # "sglang" | "vllm": engines' pages never share keys
    model: str  # the engine's model name or path
    layout: KVLayout  # layers, KV heads, head size, dtype, tokens per page, MHA / MLA
    page_format: str  # the engine's byte order of one page (e.g. "page_first"): part of the namespace
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def namespace(self, cfg: EngineConfig) -> Namespace:
        revision = cfg.revision or model_revision(self.model)
        fmt = f"{self.engine}:{self.page_format}:pp{self.pp_rank}/{self.pp_size}"
        return Namespace(self.model or "unnamed", self.layout, revision, self.tp_rank, self.tp_size,
                         cfg.tenant, fmt)


class PlacedPages(Sequence[list[memoryview]]):
    """Pages of one engine buffer whose pieces lie at ``offsets[i][j]`` with sizes ``sizes[j]`` (the same
    for every page): page ``i``'s byte views are made when a backend's I/O thread asks for them, so
    placing a batch costs nothing up front. The caller checked that every piece lies inside ``mem``."""

    def __init__(self, mem: memoryview, offsets: list[list[int]], sizes: list[int]) -> None:
        self.mem = mem
        self.offsets = offsets
        self.sizes = sizes
        self.page_bytes = sum(sizes)

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, i: int) -> list[memoryview]: ...
    @overload
    def __getitem__(self, i: slice) -> list[list[memoryview]]: ...

    def __getitem__(self, i: int | slice) -> list[memoryview] | list[list[memoryview]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        mem = self.mem
        return [mem[o:o + s] for o, s in zip(self.offsets[i], self.sizes, strict=True)]


class EngineBuffers(PageBuffers):
    """Engine pages as :class:`PageBuffers`: page ``i`` of a batch is ``pages[i]``, a list of writable byte
    views (``memoryview`` of format ``B``) into the engine's memory whose lengths add up to the page."""

    zero_copy = True

    def __init__(self, pages: Sequence[Sequence[memoryview]], page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self._pages = pages
        if isinstance(pages, PlacedPages):
            if pages.page_bytes != page_bytes:
                raise ValueError(f"pages: their pieces hold {pages.page_bytes} bytes, a page is {page_bytes}")
            return
        for i, p in enumerate(pages):
            n = sum(map(len, p))
            if n != page_bytes:
                raise ValueError(f"page {i}: its pieces hold {n} bytes, a page is {page_bytes}")

    def source(self, page: int) -> PageBuf:
        return list(self._pages[page])

    def target(self, page: int) -> PageBuf:
        return list(self._pages[page])


class EngineStore:
    """An engine shard's store: ``exists`` / ``get`` / ``set`` of pages named by the engine's keys.

    Thread-safe (the engines call from their I/O threads). Keys are bytes (the engine's page hash); each
    page is a list of byte views (:class:`EngineBuffers`). Results are counts of *leading* pages, as the
    engines' prefix semantics need: page ``i`` is usable only when every page before it is.
    """

    def __init__(self, config: Mapping[str, Any] | EngineConfig, pages: EnginePages, *, where: str,
                 backend: StorageBackend | None = None) -> None:
        self.config = config if isinstance(config, EngineConfig) else parse_config(config, where)
        self.pages = pages
        self.ns = pages.namespace(self.config)
        self.page_bytes = pages.layout.bytes_per_page
        s = self.config.storage
        if backend is None:
            ctx = StorageContext(self.ns.digest, pages.layout, pages.model, pages.tp_rank, pages.tp_size,
                                 "page_first", s.compression, s.compression_level)
            try:
                backend = create_backend(s.url, ctx, **s.options)
            except ConfigError:
                raise
            except (ValueError, TypeError) as e:
                raise ConfigError(f"{where}: url / options: {e}", f"{where}.url") from None
        self.backend = backend
        self._batch = s.io_batch_pages
        self._skipped = 0  # pages a set found stored already
        self._lock = threading.Lock()
        self._counters = counters()
        self._published: dict[str, float] = {}
        if self.config.metrics:
            serve_metrics(self.config.metrics, where)
        log.info("hicache store %s for %s (%s), namespace %s", safe_url(s.url), pages.model, pages.page_format,
                 self.ns.digest.hex()[:12])

    # ------------------------------------------------------------------ keys
    def storage_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys pages are stored under: the engine's keys inside this namespace."""
        seed = self.ns.digest
        return [hashlib.sha256(seed + k).digest() for k in keys]

    # ------------------------------------------------------------------ operations
    def exists(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (one round trip per ``io_batch_pages``)."""
        sk = self.storage_keys(keys)
        n = 0
        for lo in range(0, len(sk), self._batch):
            part = sk[lo:lo + self._batch]
            got = self.backend.batch_exists(part)
            n += got
            if got < len(part):
                break
        self.publish()
        return n

    def get(self, keys: Sequence[bytes], pages: Sequence[Sequence[memoryview]]) -> int:
        """Read ``keys`` into ``pages``; how many from the first were read and verified (pages after that
        are undefined: the engine recomputes them)."""
        if len(keys) != len(pages):
            raise ValueError(f"get: {len(keys)} keys but {len(pages)} pages")
        bufs = EngineBuffers(pages, self.page_bytes)
        sk = self.storage_keys(keys)
        n = 0
        for lo in range(0, len(sk), self._batch):
            hi = min(lo + self._batch, len(sk))
            got = self.backend.batch_get(sk[lo:hi], bufs, range(lo, hi))
            n += got
            if got < hi - lo:
                break
        self.publish()
        return n

    def set(self, keys: Sequence[bytes], pages: Sequence[Sequence[memoryview]]) -> int:
        """Store ``pages`` under ``keys``, skipping the leading pages already stored (another process wrote
        them); returns how many from the first are now stored."""
        if len(keys) != len(pages):
            raise ValueError(f"set: {len(keys)} keys but {len(pages)} pages")
        bufs = EngineBuffers(pages, self.page_bytes)
        sk = self.storage_keys(keys)
        n = 0
        for lo in range(0, len(sk), self._batch):
            hi = min(lo + self._batch, len(sk))
            have = self.backend.batch_exists(sk[lo:hi])
            if have:
                with self._lock:
                    self._skipped += have
            done = have
            if have < hi - lo:
                done += self.backend.batch_set(sk[lo + have:hi], bufs, range(lo + have, hi))
            n += done
            if done < hi - lo:
                break
        self.publish()
        return n

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.backend.delete(self.storage_keys(keys))

    def clear(self) -> int:
        """Delete every page of this store's prefix / folder (all namespaces in it); how many. Raises on a
        store that is down (an admin operation)."""
        clear = getattr(self.backend, "clear", None)
        if clear is None:
            raise NotImplementedError(f"{type(self.backend).__name__} cannot be cleared")
        n = clear()
        return int(n or 0)

    def stats(self) -> dict[str, float]:
        """The backend's counters by ``StorageStats`` field (``hicache_storage_*`` without the prefix), plus
        ``skipped_writes`` (pages a set found stored already)."""
        st = self.backend.stats()
        out: dict[str, float] = {f.name: float(getattr(st, f.name)) for f in dataclasses.fields(st)
                                 if f.name != "extra"}
        out.update({k: float(v) for k, v in st.extra.items() if isinstance(v, (int, float))})
        with self._lock:
            out["skipped_writes"] = float(self._skipped)
        return out

    def describe(self) -> dict[str, Any]:
        """What this store is (for logs and ``get_stats``): URL without secrets, namespace, page size."""
        return {"url": safe_url(self.config.storage.url), "namespace": self.ns.digest.hex()[:16],
                "model": self.ns.model, "revision": self.ns.revision, "format": self.ns.page_format,
                "tp": f"{self.ns.tp_rank}/{self.ns.tp_size}", "page_bytes": self.page_bytes}

    def publish(self) -> None:
        """Bring the process's ``hicache_storage_*`` counters up to date with this store's (every operation
        does)."""
        self._counters.publish(self._published, self.stats())

    def close(self) -> None:
        self.publish()
        self.backend.close()

    def __repr__(self) -> str:
        return f"EngineStore({json.dumps(self.describe())})"


# ---------------------------------------------------------------------- metrics
class _Counters:
    """This process's ``hicache_storage_*`` counters, summed over its engine stores, as real Prometheus
    counters in the default registry: an engine that serves its own ``/metrics`` in Prometheus'
    multiprocess mode (SGLang with ``--enable-metrics``, vLLM) shows them there, from whichever of its
    processes runs the store; ``metrics`` in the configuration serves them on an endpoint of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from prometheus_client import REGISTRY, Counter

        self.registry = reg = registry if registry is not None else REGISTRY
        self.by_field = {f: Counter(name, doc, registry=reg) for f, name, doc in STORAGE_COUNTERS}
        self.by_field["skipped_writes"] = Counter(
            "hicache_storage_skipped_writes", "Pages an engine asked to write that the store held already "
            "(written by another process)", registry=reg)
        self.lock = threading.Lock()

    def publish(self, seen: dict[str, float], now: dict[str, float]) -> None:
        """Add what ``now`` counts beyond ``seen`` (one store's last published figures); updates ``seen``."""
        with self.lock:
            for f, c in self.by_field.items():
                d = now.get(f, 0.0) - seen.get(f, 0.0)
                if d > 0:
                    c.inc(d)
                    seen[f] = now.get(f, 0.0)


_COUNTERS: _Counters | None = None
_SERVED: set[str] = set()
_SERVED_LOCK = threading.Lock()


def counters() -> _Counters:
    """The process's counters (created on first use)."""
    global _COUNTERS
    with _SERVED_LOCK:
        if _COUNTERS is None:
            _COUNTERS = _Counters()
        return _COUNTERS


def serve_metrics(addr: str, where: str) -> None:
    """Serve the default Prometheus registry (which holds the ``hicache_storage_*`` counters) on
    ``http://HOST:PORT/metrics`` once per process (later calls for the same address are no-ops);
    ``ConfigError`` when the port cannot be bound."""
    from prometheus_client import start_http_server

    reg = counters().registry
    with _SERVED_LOCK:
        if addr in _SERVED:
            return
        host, _, port = addr.rpartition(":")
        try:
            start_http_server(int(port), addr=host.strip("[]"), registry=reg)
        except OSError as e:
            raise ConfigError(f"{where}: metrics: cannot listen on {addr} ({e.strerror or e})",
                              f"{where}.metrics") from None
        _SERVED.add(addr)
