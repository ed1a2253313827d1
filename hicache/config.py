"""One typed configuration: dataclasses that validate themselves.

Load it with :func:`load_config` from YAML (sections ``model``, ``layout``, ``cache``, ``storage``,
``serve``), then environment overrides ``HICACHE_<SECTION>__<FIELD>`` (for example
``HICACHE_CACHE__WRITE_POLICY=write_back``), then explicit overrides (CLI flags). Every bad value raises
:class:`ConfigError` naming the field and what is allowed; when the value came from an environment variable,
the message starts with that variable (``HICACHE_CACHE__L1_TOKENS=abc: cache.l1_tokens: must be an
integer, got 'abc'``), since the variable, not a file, is what the operator has to fix.

This module holds the sections (dataclasses), :func:`config_from_dict` and :func:`load_config`; the
machinery they load with (text to field types, environment overrides and whom an error is blamed on,
merging, reading the file, and :class:`ConfigError` itself) is :mod:`hicache.config_load`'s.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.config_load import (
    ConfigError,
    blame_env,
    build_section,
    env_overrides,
    merge,
    read_config_file,
    require,
)
from hicache.eviction import policy_names
from hicache.keys import Namespace
from hicache.layout import DTYPES, HOST_LAYOUTS, KVLayout
from hicache.storage.page_codec import LEVELS, codec_names

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
IO_BACKENDS = ("auto", "cpu", "kernel", "copy_engine", "staged")
# tuning of the CUDA transfer engine (hicache.transfer.cuda.CudaTransferEngine), by keyword: minimum value
TRANSFER_INT_OPTIONS = {"blocks": 1, "threads": 32, "ce_min_copy_bytes": 1, "staging_bytes": 4, "stagger_ways": 1,
                        "backup_streams": 1, "resident_blocks": 1, "stage_lanes": 1,
                        "backup_slots": 4, "load_streams": 1, "stage_blocks": 1, "load_head_layers": 0,
                        "head_blocks": 1, "submit_ahead": 0}
LAYER_SIGNALS = ("auto", "flags", "events")
# the staged path's device-side copies: one kernel per staging chunk, or one resident kernel per transfer
STAGED_KERNELS = ("per_chunk", "resident")
# how the staged path lays out a block-first pool's slots: mirroring its blocks (whole blocks move as one
# copy), or lc-major (one copy per layer, K/V and run of pages)
BLOCK_STAGINGS = ("mirror", "lc_major")
TRANSFER_CHOICE_OPTIONS = {"layer_signal": LAYER_SIGNALS, "staged_kernel": STAGED_KERNELS,
                           "block_staging": BLOCK_STAGINGS}
TRANSFER_OPTIONS = (*TRANSFER_INT_OPTIONS, *TRANSFER_CHOICE_OPTIONS)


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot be a bearer token, or None: it travels in a gRPC metadata value, which holds
    visible ASCII only (a token read from a file often ends in a newline). The reason never quotes it."""
    if all("!" <= c <= "~" for c in token):
        return None
    return ("must be visible ASCII: no spaces, control characters (a trailing newline from a file?) or "
            "non-ASCII characters")


@dataclass
class ModelConfig:
    """``model``: what the KV belongs to. Name, revision, TP rank/size and tenant all enter every page's
    namespace, so pages of different weights, shards or tenants never match each other."""

    name: str = "default"  # model id; part of every page key's namespace
    revision: str = "main"  # weights revision: different weights never share pages
    tenant: str = ""  # default tenant salt (requests may carry their own)
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        require(bool(self.name), "model.name", "a non-empty string", self.name)
        require(self.tp_size >= 1, "model.tp_size", ">= 1", self.tp_size)
        require(0 <= self.tp_rank < self.tp_size, "model.tp_rank", f"in [0, {self.tp_size})", self.tp_rank)


@dataclass
class LayoutConfig:
    """``layout``: the KV shape of one token per layer (heads, head size, dtype; MHA keeps K and V, MLA
    one latent) and the page size in tokens. Part of the namespace: another layout is another cache."""

    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    page_size: int = 64
    attention: str = "mha"

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            v = getattr(self, f)
            require(isinstance(v, int) and v >= 1, f"layout.{f}", "an integer >= 1", v)
        require(self.dtype in DTYPES, "layout.dtype", f"one of {sorted(DTYPES)}", self.dtype)
        require(self.attention in ("mha", "mla"), "layout.attention", "'mha' or 'mla'", self.attention)
        require(self.attention != "mla" or self.num_kv_heads == 1, "layout.num_kv_heads", "1 for MLA",
                 self.num_kv_heads)

    def to_layout(self) -> KVLayout:
        """The :class:`~hicache.layout.KVLayout` (byte sizes, tensor shapes) this section describes."""
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.page_size,
                        self.attention)  # type: ignore[arg-type]


@dataclass
class CacheConfig:
    """``cache``: L1 (device) and L2 (pinned host) capacities, L2's memory layout, the write, eviction
    and transfer policies. Capacities are in tokens and round down to whole pages."""

    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    l1_tokens: int = 65536  # L1 (device) capacity in tokens, rounded down to whole pages
    l2_tokens: int = 262144  # L2 (host) capacity in tokens; 0 disables L2
    host_layout: str = "page_first"  # page_first | layer_first | block_first (hicache.pool)
    host_block_pages: int = 0  # block_first: pages per block; 0 = pool.default_block_pages
    # write_through: every committed page is backed up to L2 (and so to L3) at once, so a prefix evicted
    # from L1 before its first reuse is still found below. write_through_selective saves that host
    # bandwidth for one-off prefixes but loses such pages: on long reuse distances (Mooncake's trace)
    # it hit 37% against 65% (`hicache bench`, embedded defaults otherwise).
    write_policy: str = "write_through"
    eviction_policy: str = "hedge_lru"  # LRU unless simulated probation orders hit more (hicache.eviction.HedgeLRU)
    io_backend: str = "auto"  # auto | cpu | kernel | copy_engine | staged
    max_pinned_fraction: float = 0.5  # of L1 (and of L2) that pinned prefixes may hold (HiCache.pin)
    # CUDA transfer engine tuning (TRANSFER_OPTIONS), e.g. {stagger_ways: 4, ce_min_copy_bytes: 65536}
    transfer_options: dict[str, Any] = field(default_factory=dict)
    # Tenant -> share (0, 1] of L1 and of L2 beyond which that tenant's pages are evicted first ("*": every
    # tenant not listed; "": requests without a tenant). Soft: a tenant may fill free room past its share.
    tenant_shares: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(self.l1_tokens >= 1, "cache.l1_tokens", ">= 1", self.l1_tokens)
        require(self.l2_tokens >= 0, "cache.l2_tokens", ">= 0", self.l2_tokens)
        require(self.host_layout in HOST_LAYOUTS, "cache.host_layout", f"one of {HOST_LAYOUTS}",
                 self.host_layout)
        require(self.host_block_pages >= 0, "cache.host_block_pages", ">= 0", self.host_block_pages)
        require(self.write_policy in WRITE_POLICIES, "cache.write_policy", f"one of {WRITE_POLICIES}",
                 self.write_policy)
        names = policy_names()
        require(self.eviction_policy in names, "cache.eviction_policy", f"one of {names}", self.eviction_policy)
        require(self.io_backend in IO_BACKENDS, "cache.io_backend", f"one of {IO_BACKENDS}", self.io_backend)
        require(0 <= self.max_pinned_fraction <= 1, "cache.max_pinned_fraction", "in [0, 1]",
                 self.max_pinned_fraction)
        for key, value in self.transfer_options.items():
            where = f"cache.transfer_options.{key}"
            require(key in TRANSFER_OPTIONS, "cache.transfer_options", f"keys among {list(TRANSFER_OPTIONS)}", key)
            if key in TRANSFER_CHOICE_OPTIONS:
                choices = TRANSFER_CHOICE_OPTIONS[key]
                require(value in choices, where, f"one of {choices}", value)
            else:
                low = TRANSFER_INT_OPTIONS[key]
                require(isinstance(value, int) and not isinstance(value, bool) and value >= low, where,
                         f"an integer >= {low}", value)
        require(isinstance(self.tenant_shares, dict), "cache.tenant_shares", "a mapping of tenant -> share",
                 self.tenant_shares)
        for tenant, share in self.tenant_shares.items():
            require(isinstance(tenant, str), "cache.tenant_shares", "tenant names (strings) as keys", tenant)
            shown = tenant if tenant else '""'
            require(isinstance(share, int | float) and not isinstance(share, bool) and 0 < share <= 1,
                     f"cache.tenant_shares.{shown}", "a number in (0, 1]", share)
        require(self.device == "cpu" or self.device.startswith("cuda"), "cache.device",
                 "'cpu' or 'cuda[:N]'", self.device)


@dataclass
class StorageConfig:
    """``storage``: the L3 store (a URL; empty turns L3 off), how prefetches from it wait
    (``best_effort`` / ``wait_complete`` / ``timeout``) and how writebacks to it are batched and queued."""

    url: str = ""  # "" disables L3; memory://, redis://..., redis+cluster://..., file:///path, s3://...
    prefetch_policy: str = "timeout"
    prefetch_threshold_tokens: int = 256  # prefetch only L3 runs at least this long
    prefetch_timeout_base_s: float = 2.0
    prefetch_timeout_per_1k_tokens_s: float = 0.1
    prefetch_timeout_max_s: float = 30.0
    prefetch_max_inflight_bytes: int = 4 << 30
    io_batch_pages: int = 128  # L3 get/set batch size
    writeback_queue_pages: int = 16384
    writeback_when_full: str = "block"  # block | drop (dropped pages are counted)
    # lossless page compression for L3 (none | zstd | lz4): byte shuffle + codec, bit-exact; pages that do
    # not shrink are stored as they are. Any node reads any codec, so nodes may differ.
    compression: str = "none"
    compression_level: int = 0  # 0: the codec's default (zstd 1); higher: smaller and slower writes
    options: dict[str, Any] = field(default_factory=dict)  # backend-specific (timeouts, TTL, prefix...)

    def __post_init__(self) -> None:
        require(self.prefetch_policy in PREFETCH_POLICIES, "storage.prefetch_policy",
                 f"one of {PREFETCH_POLICIES}", self.prefetch_policy)
        require(self.prefetch_threshold_tokens >= 0, "storage.prefetch_threshold_tokens", ">= 0",
                 self.prefetch_threshold_tokens)
        for f in ("prefetch_timeout_base_s", "prefetch_timeout_per_1k_tokens_s", "prefetch_timeout_max_s"):
            require(getattr(self, f) >= 0, f"storage.{f}", ">= 0", getattr(self, f))
        require(self.prefetch_max_inflight_bytes > 0, "storage.prefetch_max_inflight_bytes", "> 0",
                 self.prefetch_max_inflight_bytes)
        require(self.io_batch_pages >= 1, "storage.io_batch_pages", ">= 1", self.io_batch_pages)
        require(self.writeback_queue_pages >= 1, "storage.writeback_queue_pages", ">= 1",
                 self.writeback_queue_pages)
        require(self.writeback_when_full in ("block", "drop"), "storage.writeback_when_full",
                 "'block' or 'drop'", self.writeback_when_full)
        require(self.compression in codec_names(), "storage.compression", f"one of {codec_names()}",
                 self.compression)
        require(LEVELS[0] <= self.compression_level <= LEVELS[1], "storage.compression_level",
                 f"in [{LEVELS[0]}, {LEVELS[1]}] (0: the codec's default)", self.compression_level)

    def prefetch_timeout(self, tokens: int) -> float:
        """Seconds the ``timeout`` policy waits for a prefetch of ``tokens`` tokens."""
        t = self.prefetch_timeout_base_s + self.prefetch_timeout_per_1k_tokens_s * tokens / 1000.0
        return min(t, self.prefetch_timeout_max_s)


@dataclass
class ServeConfig:
    """``serve``: the gRPC node's address, limits (concurrency, message and request sizes), auth (one token, or
    tokens mapped to tenants) and TLS, the metrics address, port and token, and the grace a shutdown gives
    in-flight calls and queued L3 writes."""

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9400  # 0 disables the /metrics HTTP endpoint
    metrics_host: str = "127.0.0.1"  # /metrics binds here, not serve.host: loopback unless Prometheus is elsewhere
    metrics_token: str = ""  # bearer token /metrics requires ("": none)
    metrics_tls: bool = False  # serve /metrics over HTTPS with serve.tls_cert / tls_key
    max_concurrency: int = 256  # RPCs in flight beyond this get RESOURCE_EXHAUSTED
    max_message_bytes: int = 64 << 20
    max_request_tokens: int = 1 << 20
    auth_token: str = ""  # bearer token; "" disables auth (with auth_tokens_file: an admin token)
    auth_tokens_file: str = ""  # YAML: tokens -> the tenants each may act for, or admin (hicache.service.auth)
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""  # set for mTLS
    shutdown_grace_s: float = 30.0
    shared_pool: bool = True  # share the L1 pool with clients on this host (shm on CPU, CUDA IPC on GPU)

    def __post_init__(self) -> None:
        require(0 <= self.port < 65536, "serve.port", "in [0, 65535]", self.port)
        require(0 <= self.metrics_port < 65536, "serve.metrics_port", "in [0, 65535]", self.metrics_port)
        require(self.max_concurrency >= 1, "serve.max_concurrency", ">= 1", self.max_concurrency)
        require(math.isfinite(self.shutdown_grace_s) and self.shutdown_grace_s >= 0, "serve.shutdown_grace_s",
                 "a number >= 0", self.shutdown_grace_s)
        require(self.max_message_bytes >= 1 << 20, "serve.max_message_bytes", ">= 1 MiB", self.max_message_bytes)
        require(self.max_request_tokens >= 1, "serve.max_request_tokens", ">= 1", self.max_request_tokens)
        for name in ("auth_token", "metrics_token"):
            why = token_problem(getattr(self, name))
            if why is not None:  # no client could send it: every call would be refused
                raise ConfigError(f"serve.{name}: {why}", f"serve.{name}")
        require(bool(self.metrics_host), "serve.metrics_host", "an address to bind /metrics on",
                 self.metrics_host)
        require(bool(self.tls_cert) == bool(self.tls_key), "serve.tls_key", "set together with serve.tls_cert",
                 self.tls_key)
        require(not self.metrics_tls or bool(self.tls_cert), "serve.metrics_tls",
                 "set only with serve.tls_cert and serve.tls_key (the certificate it serves)", self.metrics_tls)
        # mTLS without TLS would serve plaintext while the operator believes clients are checked
        require(not self.tls_client_ca or bool(self.tls_cert), "serve.tls_client_ca",
                 "set only with serve.tls_cert and serve.tls_key (mTLS needs TLS)", self.tls_client_ca)


@dataclass
class HiCacheConfig:
    """The whole configuration: one section per concern, each checked when built (:class:`ConfigError`
    naming the field). Build it with :func:`load_config` (file, environment, overrides) or
    :func:`config_from_dict`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self) -> None:
        require(self.cache.l1_tokens >= self.layout.page_size, "cache.l1_tokens",
                 f">= layout.page_size ({self.layout.page_size})", self.cache.l1_tokens)

    @property
    def l1_pages(self) -> int:
        """L1 capacity in whole pages."""
        return self.cache.l1_tokens // self.layout.page_size

    @property
    def l2_pages(self) -> int:
        """L2 capacity in whole pages (0: no L2)."""
        return self.cache.l2_tokens // self.layout.page_size

    def namespace(self, tenant: str | None = None) -> Namespace:
        """The page-key namespace of this model and layout, under ``tenant`` (None: ``model.tenant``)."""
        m = self.model
        return Namespace(m.name, self.layout.to_layout(), m.revision, m.tp_rank, m.tp_size,
                         m.tenant if tenant is None else tenant)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts (for YAML/JSON, and :func:`config_from_dict` again)."""
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "layout": LayoutConfig,
    "cache": CacheConfig,
    "storage": StorageConfig,
    "serve": ServeConfig,
}


def config_from_dict(data: Mapping[str, Any]) -> HiCacheConfig:
    """Sections of plain values -> :class:`HiCacheConfig`; :class:`ConfigError` for an unknown section or
    field, or a value a section refuses."""
    for section in data:
        if section not in _SECTIONS:
            raise ConfigError(f"{section}: unknown section; known: {sorted(_SECTIONS)}")
    sections = {}
    for s in _SECTIONS:
        raw = data.get(s) or {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{s}: must be a mapping, got {type(raw).__name__}")
        sections[s] = build_section(_SECTIONS[s], s, raw)
    return HiCacheConfig(**sections)


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> HiCacheConfig:
    """YAML file (optional) < environment ``HICACHE_<SECTION>__<FIELD>`` < explicit ``overrides``."""
    data = read_config_file(path) if path is not None else {}
    env = os.environ if env is None else env
    try:
        return config_from_dict(merge(data, env_overrides(env), overrides or {}))
    except ConfigError as e:
        raise blame_env(e, env, overrides, file_sections=data) from None
