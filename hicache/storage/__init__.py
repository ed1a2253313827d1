"""L3 storage: backend interface, registry, page frames, page codecs, and the built-in backends.

The names below are loaded on first use (:pep:`562`), and the backends on first use of their scheme
(``BACKENDS``' lazy modules), so ``hicache.storage.page_codec``, which the config reads for
``storage.compression``, comes without torch or the pools.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache.storage' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
