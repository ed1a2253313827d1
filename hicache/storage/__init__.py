"""L3 storage: backend interface, registry, page frames, page codecs, and the built-in backends.

The names below are loaded on first use (:pep:`562`), and the backends on first use of their scheme
(``BACKENDS``' lazy modules), so ``hicache.storage.page_codec``, which the config reads for
``storage.compression``, comes without torch or the pools.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.registry import lazy_exports

_EXPORTS = {
    "StorageBackend": "hicache.storage.base",
    "StorageContext": "hicache.storage.base",
    "StorageStats": "hicache.storage.base",
    "create_backend": "hicache.storage.base",
    "register_backend": "hicache.storage.base",
}

__all__ = ["StorageBackend", "StorageContext", "StorageStats", "create_backend", "register_backend"]

if TYPE_CHECKING:
    from hicache.storage.base import StorageBackend, StorageContext, StorageStats, create_backend, register_backend


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
