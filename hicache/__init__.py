"""hicache: a three-tier KV cache (GPU radix cache, pinned host memory, distributed store) for LLM serving.

The names below are loaded on first use (:pep:`562`), so ``import hicache.config`` or the ``hicache``
command's start does not pay for torch until something needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.registry import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "CacheFullError": "hicache.cache",
    "CommitResult": "hicache.cache",
    "HiCache": "hicache.cache",
    "LoadResult": "hicache.cache",
    "Request": "hicache.cache",
    "ConfigError": "hicache.config",
    "HiCacheConfig": "hicache.config",
    "load_config": "hicache.config",
    "Namespace": "hicache.keys",
    "page_keys": "hicache.keys",
    "KVLayout": "hicache.layout",
}

__all__ = [
    "CacheFullError",
    "CommitResult",
    "ConfigError",
    "HiCache",
    "HiCacheConfig",
    "KVLayout",
    "LoadResult",
    "Namespace",
    "Request",
    "__version__",
    "load_config",
    "page_keys",
]

if TYPE_CHECKING:
    from hicache.cache import CacheFullError, CommitResult, HiCache, LoadResult, Request
    from hicache.config import ConfigError, HiCacheConfig, load_config
    from hicache.keys import Namespace, page_keys
    from hicache.layout import KVLayout


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
