"""L3 storage interface and the backend registry.

A backend stores whole pages by page key. Its contract:

* ``batch_exists(keys)`` -> how many keys *from the first* are present (hits are a contiguous prefix,
  because key i names page i and everything before it).
* ``batch_get(keys, host_pool, host_indices)`` -> ``n``: pages ``0..n-1`` were read into the given L2
  pages (of hicache's host pool, or of any :class:`hicache.storage.pageio.PageBuffers`: an engine's),
  verified (namespace, key, length, checksum): ``n`` is the length of the unbroken run of good pages
  from the first. A backend may read the whole batch; host pages from ``n`` on are undefined. A
  damaged or foreign page is a miss, never a wrong page.
* ``batch_set(keys, host_pool, host_indices)`` -> how many pages from the first were stored.
* ``delete(keys)`` -> how many existed; ``stats()`` -> :class:`StorageStats`; ``close()``.
* ``probe()`` -> ``None`` when the store answers a round trip now, else one line saying why not (for a
  tool that must not go on without its store; the cache itself carries on with L3 paused).
* Operations never raise for a store that is down or slow: they count the error and report a miss /
  nothing written. They raise ``ValueError`` only for caller bugs (mismatched lengths).
* Backends are thread-safe: the cache calls them from its prefetch and writeback workers.

Backends register under a URL scheme (``@register_backend("redis", "rediss")``) and are created with
:func:`create_backend` from a URL such as ``memory://``, ``redis://host:6379/0``, ``file:///var/cache``.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from hicache.layout import KVLayout
from hicache.pool import HostPool
from hicache.registry import Registry
from hicache.storage.frame import PageBuf, pack_page
from hicache.storage.page_codec import PageCodec, make_codec
from hicache.storage.pageio import PageBuffers


def safe_url(url: str) -> str:
    """``url`` without its ``user:password@`` and query (which may carry passwords): for logs and errors."""
    u = urlparse(url)
    return u._replace(netloc=u.netloc.rsplit("@", 1)[-1], query="").geturl()


@dataclass(frozen=True)
class StorageContext:
    """What a backend is told about the pages it will store (mirrors SGLang's storage config)."""

    namespace_digest: bytes  # 32 bytes; written into every frame and checked on read
    layout: KVLayout
    model: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    host_layout: str = "page_first"
    compression: str = "none"  # the codec pages are written with (:mod:`hicache.storage.page_codec`); reads take any
    compression_level: int = 0  # 0: the codec's default

    @property
    def is_mla(self) -> bool:
        return self.layout.attention == "mla"


@dataclass
class StorageStats:
    """Counters every backend keeps (read under the backend's own lock)."""

    gets: int = 0  # pages returned by batch_get
    get_misses: int = 0  # pages asked for and not returned
    sets: int = 0  # pages stored
    bytes_read: int = 0
    bytes_written: int = 0
    corrupt_pages: int = 0  # frames that failed verification (counted as misses)
    errors: int = 0  # store failures (down, timeout, ...): per page for files, per operation for Redis
    extra: dict[str, Any] = field(default_factory=dict)
    stored_bytes_read: int = 0  # payload bytes of the pages read, as stored (compressed or not; no headers)
    stored_bytes_written: int = 0  # the same for pages written: bytes_written / this = the compression ratio


class StorageBackend(abc.ABC):
    """Base class; subclasses implement the five operations of the module contract."""

    scheme: str = ""

    def __init__(self, url: str, ctx: StorageContext, **options: Any) -> None:
        self.url = url
        self.ctx = ctx
        self.options = options
        self._stats = StorageStats()
        self._stats_lock = threading.Lock()
        if ctx is not None:  # (an unknown codec is refused here, before any connection)
            _ = self.codec

    @functools.cached_property
    def codec(self) -> PageCodec:
        """The codec pages are written with (``storage.compression``)."""
        return make_codec(self.ctx.compression, self.ctx.compression_level)

    @functools.cached_property
    def elem(self) -> int:
        """The byte shuffle's element size: the KV dtype's."""
        return self.ctx.layout.element_size

    def pack(self, page: PageBuf, key: bytes) -> tuple[bytes, PageBuf]:
        """One page's frame as (header, payload), compressed with ``storage.compression`` where that saves
        space (:func:`hicache.storage.frame.pack_page`)."""
        return pack_page(page, self.ctx.namespace_digest, key, self.codec, self.elem)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    @staticmethod
    def _check_lengths(keys: Sequence[bytes], host_indices: Sequence[int]) -> None:
        if len(keys) != len(host_indices):
            raise ValueError(f"storage: {len(keys)} keys but {len(host_indices)} host pages")

    @abc.abstractmethod
    def batch_exists(self, keys: Sequence[bytes]) -> int: ...

    @abc.abstractmethod
    def batch_get(self, keys: Sequence[bytes], host_pool: HostPool | PageBuffers, host_indices: Sequence[int]
                  ) -> int: ...

    @abc.abstractmethod
    def batch_set(self, keys: Sequence[bytes], host_pool: HostPool | PageBuffers, host_indices: Sequence[int]
                  ) -> int: ...

    @abc.abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int: ...

    def stats(self) -> StorageStats:
        with self._stats_lock:
            s = self._stats
            return dataclasses.replace(s, extra=dict(s.extra))

    @property
    def url_safe(self) -> str:
        """The URL without credentials or query (for logs and errors)."""
        return safe_url(self.url)

    def probe(self) -> str | None:
        """One round trip to the store: ``None`` when it answers (and, where that can be checked
        cheaply, takes writes), else one line saying why not. Never raises; counts nothing."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections / handles."""


BackendFactory = Callable[..., StorageBackend]
# Modules imported on first use of a scheme, so optional dependencies load only when needed.
BACKENDS: Registry[BackendFactory] = Registry("storage.url", "scheme", lazy={
    "memory": "hicache.storage.memory",
    "redis": "hicache.storage.redis_backend",
    "rediss": "hicache.storage.redis_backend",
    "redis+sentinel": "hicache.storage.redis_backend",
    "rediss+sentinel": "hicache.storage.redis_backend",
    "redis+cluster": "hicache.storage.redis_backend",
    "rediss+cluster": "hicache.storage.redis_backend",
    "file": "hicache.storage.file_backend",
    "s3": "hicache.storage.file_backend",
    "hdfs": "hicache.storage.file_backend",
    "gs": "hicache.storage.file_backend",
})


def register_backend(*schemes: str) -> Callable[[Any], Any]:
    return BACKENDS.register(*schemes)


def create_backend(url: str, ctx: StorageContext, **options: Any) -> StorageBackend:
    """Create the backend registered for ``url``'s scheme; ``ValueError`` names unknown schemes."""
    scheme = urlparse(url).scheme or "file"
    factory = BACKENDS.find(scheme)
    if factory is None:
        raise ValueError(f"storage.url: unknown scheme {scheme!r} in {safe_url(url)!r}; known: {BACKENDS.names()}")
    return factory(url, ctx, **options)
