"""hicache: a three-tier KV cache (GPU radix cache, pinned host memory, distributed store) for LLM serving."""

from hicache.cache import CacheFullError, CommitResult, HiCache, LoadResult, Request
from hicache.config import ConfigError, HiCacheConfig, load_config
from hicache.keys import Namespace, page_keys
from hicache.layout import KVLayout

__version__ = "0.1.0"

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
