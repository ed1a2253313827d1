"""hicache as SGLang HiCache's storage tier (L3): an unmodified ``sglang.launch_server`` loads it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "hicache",
        "module_path": "hicache.integrations.sglang", "class_name": "HiCacheStore", "interface_v1": 1,
        "url": "redis+cluster://redis-0:6379", "tenant": ""}'

The keys besides SGLang's own four (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``)
are hicache's storage configuration (:mod:`hicache.integrations.store`: url, tenant, revision,
compression, io_batch_pages, options, metrics), validated when SGLang creates the backend: a bad value
stops the server with one line naming the field.

Contract with SGLang (checked against sglang 0.5.23 by ``tests/integrations``):

* SGLang builds ``HiCacheStore(storage_config, kwargs)`` and then hands over its host pool
  (``register_mem_pool_host``). The pool tells the KV layout (layers, heads, head size, dtype, page size,
  MHA / MLA) and its memory layout (``page_first``, ``page_first_direct``, ``layer_first``); both enter the
  namespace with the model, its revision, the TP / PP / CP shard and the tenant, so pages of another
  model, layout or shard are never served.
* ``interface_v1: 1``: ``batch_get_v1`` / ``batch_set_v1`` read and write the host pool in place, each
  page as the pieces ``get_page_buffer_meta`` names (K and V, or every layer's), without a copy.
  ``interface_v1: 0``: ``batch_get`` / ``batch_set`` take SGLang's flat page tensors. Both paths store
  the same bytes (the pieces in ``get_page_buffer_meta`` order), so a page written by one is read by the
  other.
* ``batch_exists`` is the count of leading pages stored (one round trip per io batch); writes skip the
  leading pages already stored; a damaged or foreign page is a miss (SGLang recomputes it), counted.
* MLA: the latent is the same on every TP rank, so the ranks share pages (namespace TP 1) and only
  SGLang's storage writer rank writes them.
* ``get_stats`` returns SGLang's ``StorageMetrics`` (pages and GB/s per operation since the last call,
  what ``--enable-storage-metrics`` plots) with hicache's counters as its ``hicache`` attribute; the
  ``hicache_storage_*`` counters also appear on SGLang's own ``/metrics`` (``--enable-metrics``, which runs
  Prometheus in multiprocess mode) and, with ``metrics``, on an endpoint of their own.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hicache.config import ConfigError
from hicache.integrations.store import EngineConfig, EnginePages, EngineStore, PlacedPages, parse_config
from hicache.layout import DTYPES, KVLayout

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
except ImportError as e:  # pragma: no cover - only without SGLang
    raise ImportError("hicache.integrations.sglang is SGLang's storage backend: install sglang to use it "
                      f"({e})") from e

log = logging.getLogger(__name__)

WHERE = "--hicache-storage-backend-extra-config"
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
LAYOUTS = ("page_first", "page_first_direct", "layer_first")


def hicache_fields(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """hicache's part of SGLang's extra config (SGLang's own keys dropped)."""
    return {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}


def pool_layout(pool: Any) -> tuple[KVLayout, str]:
    """``(KVLayout, memory layout)`` of an SGLang host pool (MHA or MLA); ``ConfigError`` for one hicache
    cannot frame (an unknown dtype, another memory layout)."""
    dtype = str(pool.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ConfigError(f"{WHERE}: the host pool's dtype {dtype} is not one of {sorted(DTYPES)}", WHERE)
    if pool.layout not in LAYOUTS:
        raise ConfigError(f"{WHERE}: the host pool's layout {pool.layout!r} is not one of {LAYOUTS} "
                          "(--hicache-mem-layout)", WHERE)
    if hasattr(pool, "kv_lora_rank"):  # MLA: one latent of kv_cache_dim per token and layer
        layout = KVLayout(pool.layer_num, 1, int(pool.kv_cache_dim), dtype, pool.page_size, "mla")
    else:
        v_dim = getattr(pool, "v_head_dim", pool.head_dim)
        if v_dim != pool.head_dim:
            raise ConfigError(f"{WHERE}: K and V of different widths ({pool.head_dim} / {v_dim}) are not "
                              "supported by this backend", WHERE)
        layout = KVLayout(pool.layer_num, pool.head_num, pool.head_dim, dtype, pool.page_size, "mha")
    return layout, pool.layout


class _PoolView:
    """Byte views of pages of an SGLang host pool, at the pointers ``get_page_buffer_meta`` gives.

    Those pointers are affine in a page's first token for every layout SGLang has (piece ``j`` of the page
    at token ``t`` lies at ``offset[j] + t * slope[j]``): the view reads the pool's own metadata for three
    pages (the first two and the last), checks that it fits that form, and then places pieces with one
    array operation per batch instead of SGLang's per-piece Python loop. Where it does not fit (a layout
    this backend does not know), every batch asks ``get_page_buffer_meta``. Every piece is checked to lie
    in the pool's buffer."""

    def __init__(self, pool: Any, layout: KVLayout) -> None:
        self.pool = pool
        buf: torch.Tensor = pool.kv_buffer
        if buf.device.type != "cpu":
            raise ConfigError(f"{WHERE}: the host pool's buffer is on {buf.device}, not in host memory", WHERE)
        self.base = buf.data_ptr()
        self.nbytes = buf.numel() * buf.element_size()
        self.mem = memoryview((ctypes.c_char * self.nbytes).from_address(self.base)).cast("B")
        self.page_size = pool.page_size
        self.page_bytes = layout.bytes_per_page
        self.mha_layer_first = layout.attention == "mha" and pool.layout == "layer_first"
        self.num_layers = layout.num_layers
        self.affine: tuple[np.ndarray, np.ndarray, list[int]] | None = None
        probe = self.pages(torch.arange(self.page_size, dtype=torch.int64))
        if len(probe) != 1 or sum(len(p) for p in probe[0]) != self.page_bytes:
            raise ConfigError(f"{WHERE}: the host pool's pages are not {self.page_bytes} bytes as its shape "
                              "says (an SGLang release this backend does not know?)", WHERE)
        self.affine = self._fit(int(getattr(pool, "size", 0)))

    def _meta(self, first_token: int) -> tuple[np.ndarray, list[int]]:
        ptrs, sizes = self.pool.get_page_buffer_meta(
            torch.arange(first_token, first_token + self.page_size, dtype=torch.int64))
        return np.asarray(ptrs, dtype=np.int64) - self.base, [int(x) for x in sizes]

    def _fit(self, pool_tokens: int) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
        P = self.page_size
        last = (pool_tokens // P - 1) * P
        if last < 2 * P:
            return None
        (o0, s0), (o1, s1), (ol, sl) = self._meta(0), self._meta(P), self._meta(last)
        slope, rem = np.divmod(o1 - o0, P)
        if rem.any() or s0 != s1 or s0 != sl or not np.array_equal(o0 + last * slope, ol):
            return None
        return o0, slope, s0

    def pages(self, host_indices: torch.Tensor) -> Sequence[list[memoryview]]:
        """The pieces of each page whose tokens ``host_indices`` lists (page-aligned, in order)."""
        n = len(host_indices) // self.page_size
        if n * self.page_size != len(host_indices):
            raise ValueError(f"host_indices: {len(host_indices)} tokens is not whole pages of {self.page_size}")
        if n == 0:
            return []
        mem = self.mem
        if self.affine is not None:
            o0, slope, sizes = self.affine
            firsts = host_indices[::self.page_size].to(torch.int64).numpy()
            offs = firsts[:, None] * slope[None, :] + o0[None, :]
            if offs.min() < 0 or int((offs + np.asarray(sizes)).max()) > self.nbytes:
                raise ValueError("host pool: a page piece lies outside the pool's buffer")
            return PlacedPages(mem, offs.tolist(), sizes)
        ptrs, psizes = self.pool.get_page_buffer_meta(host_indices)
        k = len(ptrs) // n
        base, end = self.base, self.base + self.nbytes
        out: list[list[memoryview]] = []
        for i in range(n):
            pieces = []
            for p, s in zip(ptrs[i * k:(i + 1) * k], psizes[i * k:(i + 1) * k], strict=True):
                if p < base or p + s > end:
                    raise ValueError(f"host pool: a page piece at {p:#x}+{s} lies outside the pool's buffer")
                pieces.append(mem[p - base:p - base + s])
            out.append(pieces)
        return out

    def flat_pieces(self, flat: torch.Tensor) -> list[memoryview]:
        """A flat page tensor (``get_data_page(i, flat=True)``) as the pieces of the zero-copy path's byte
        order: the same bytes a v1 write stores (layer-first MHA flattens all K before all V, where the
        v1 order is K and V of each layer in turn)."""
        if flat.device.type != "cpu" or not flat.is_contiguous():
            flat = flat.to("cpu").contiguous()
        b = flat.view(torch.uint8).numpy()
        if len(b) != self.page_bytes:
            raise ValueError(f"flat page: {len(b)} bytes, a page is {self.page_bytes}")
        if not self.mha_layer_first:
            return [b.data]
        kv = b.reshape(2, self.num_layers, -1)
        return [kv[c, layer].data for layer in range(self.num_layers) for c in (0, 1)]


def _key(k: str) -> bytes:
    """SGLang's page key (lowercase hex sha256, maybe with a suffix of its own) as bytes."""
    try:
        return bytes.fromhex(k)
    except ValueError:
        return k.encode()


class HiCacheStore(HiCacheStorage):  # type: ignore[misc]  # (SGLang's class: Any to mypy)
    """SGLang's HiCache storage backend over a hicache store (module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.config: EngineConfig = parse_config(hicache_fields(storage_config.extra_config), WHERE)
        if getattr(storage_config, "should_split_heads", False):
            raise ConfigError(f"{WHERE}: heads split across a prefill / decode TP mismatch "
                              "(should_split_heads) are not supported by this backend", WHERE)
        self.is_mla = bool(storage_config.is_mla_model)
        self.writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.store: EngineStore | None = None
        self.view: _PoolView | None = None
        self._samples: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                                 "backup_bandwidth": []}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ set-up
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the store for this pool's layout (SGLang calls this once, before any I/O)."""
        super().register_mem_pool_host(mem_pool_host)
        layout, mem_layout = pool_layout(mem_pool_host)
        c = self.storage_config
        shard = "" if getattr(c, "attn_cp_size", 1) <= 1 else f":cp{c.attn_cp_rank}/{c.attn_cp_size}"
        tp_rank, tp_size = (0, 1) if self.is_mla else (c.tp_rank, c.tp_size)
        pages = EnginePages("sglang", c.model_name or "", layout, mem_layout + shard, tp_rank, tp_size,
                            c.pp_rank, c.pp_size)
        self.view = _PoolView(mem_pool_host, layout)
        if self.store is not None:
            self.store.close()
        self.store = EngineStore(self.config, pages, where=WHERE)

    def _ready(self) -> tuple[EngineStore, _PoolView]:
        if self.store is None or self.view is None:
            raise RuntimeError("hicache: no host pool registered (SGLang calls register_mem_pool_host first)")
        return self.store, self.view

    def _sample(self, op: str, pages: int, nbytes: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        with self._lock:
            self._samples[f"{op}_pgs"].append(pages)
            if pages and dt > 0:
                self._samples[f"{op}_bandwidth"].append(nbytes / dt / 1e9)

    # ------------------------------------------------------------------ zero-copy path (interface_v1: 1)
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        store, view = self._ready()
        t0 = time.perf_counter()
        n = store.get([_key(k) for k in keys], view.pages(host_indices))
        self._sample("prefetch", n, n * store.page_bytes, t0)
        return [True] * n + [False] * (len(keys) - n)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        store, view = self._ready()
        if not self.writer:  # (MLA: another rank writes the shared page)
            return [True] * len(keys)
        t0 = time.perf_counter()
        n = store.set([_key(k) for k in keys], view.pages(host_indices))
        self._sample("backup", n, n * store.page_bytes, t0)
        return [True] * n + [False] * (len(keys) - n)

    # ------------------------------------------------------------------ flat path (interface_v1: 0)
    def batch_get(self, keys: list[str], target_locations: Sequence[torch.Tensor] | None = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        store, view = self._ready()
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("batch_get: one target page tensor per key is needed")
        t0 = time.perf_counter()
        n = store.get([_key(k) for k in keys], [view.flat_pieces(t) for t in target_locations])
        self._sample("prefetch", n, n * store.page_bytes, t0)
        return [t if i < n else None for i, t in enumerate(target_locations)]

    def get(self, key: str, target_location: torch.Tensor | None = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        if target_location is None:
            _, view = self._ready()
            target_location = view.pool.get_dummy_flat_data_page()
        return self.batch_get([key], [target_location])[0]

    def batch_set(self, keys: list[str], values: Sequence[torch.Tensor] | None = None,
                  target_locations: Any = None, target_sizes: Any = None) -> bool:
        store, view = self._ready()
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set: one page tensor per key is needed")
        if not self.writer:
            return True
        t0 = time.perf_counter()
        n = store.set([_key(k) for k in keys], [view.flat_pieces(v) for v in values])
        self._sample("backup", n, n * store.page_bytes, t0)
        return n == len(keys)

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        if value is None:
            raise ValueError("set: the page tensor is needed")
        return self.batch_set([key], [value])

    # ------------------------------------------------------------------ lookups and admin
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        store, _ = self._ready()
        return store.exists([_key(k) for k in keys])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> bool:
        """Delete every page in the store's prefix / folder (every namespace in it, as SGLang's own
        backends do); False (logged) when the store is down."""
        store, _ = self._ready()
        try:
            store.clear()
        except Exception as e:  # an admin call: report, do not take the server down
            log.error("hicache: clear failed: %s", e)
            return False
        return True

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the operations since the last call, hicache's counters as its
        ``hicache`` attribute (a plain dict of both where that class is missing)."""
        with self._lock:
            samples = {k: list(v) for k, v in self._samples.items()}
            for v in self._samples.values():
                v.clear()
        counters = self.store.stats() if self.store is not None else {}
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return {**samples, "hicache": counters}
        m = StorageMetrics(**samples)
        m.hicache = counters
        return m

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
