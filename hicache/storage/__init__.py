"""L3 storage: backend interface, registry, page frames, and the built-in backends."""

from hicache.storage import memory as _memory  # noqa: F401  (registers memory://)
from hicache.storage.base import (
    StorageBackend,
    StorageContext,
    StorageStats,
    create_backend,
    register_backend,
)

__all__ = ["StorageBackend", "StorageContext", "StorageStats", "create_backend", "register_backend"]
