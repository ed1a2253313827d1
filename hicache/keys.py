"""Page keys: chained, namespaced, cryptographic.

``key_0 = sha256(ns_digest || tokens_0)`` and ``key_i = sha256(key_{i-1} || tokens_i)`` where
``tokens_i`` are the token ids of page *i* as little-endian uint32 and ``ns_digest`` is the sha256 of
the canonical namespace text (model id, weights revision, dtype, KV layout, page size, TP rank/size,
tenant salt). The chain is SGLang HiCache's storage-key scheme with the namespace as its seed, so a key
names a page *and everything before it*: two requests share key_i only if they share the first
``(i+1) * page_size`` tokens under the same namespace.

Keys are a pure function of (namespace, tokens): no seed, no Python ``hash()``, stable across
processes, machines and releases (``tests/test_keys.py`` pins golden vectors; changing the format
means bumping ``KEY_FORMAT_VERSION``).
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from hicache.layout import KVLayout

KEY_FORMAT_VERSION = 1
KEY_BYTES = 32
MAX_TOKEN_ID = 2**32 - 1
# array('I') is uint32 little-endian on every platform we run on; checked, not assumed.
_FAST_ARRAY = array.array("I").itemsize == 4 and sys.byteorder == "little"


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two pages to be interchangeable.

    ``model`` alone is not enough (it is often a local path such as ``/models``): the weights revision,
    the KV layout (which includes dtype and page size) and the TP shard are part of it, and a tenant
    salt isolates tenants that share one store.
    """

    model: str
    layout: KVLayout
    revision: str = "main"
    tp_rank: int = 0
    tp_size: int = 1
    tenant: str = ""
    # the byte order of a page when an engine, not hicache's pool, defines it (e.g. "sglang:page_first");
    # "" for hicache's own canonical order (and then absent from the text, so older keys stay the same)
    page_format: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("namespace.model: must be a non-empty string")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"namespace.tp_rank/tp_size: need 0 <= tp_rank < tp_size, got {self.tp_rank}/{self.tp_size}"
            )

    def describe(self) -> str:
        parts = [
            f"hicache-ns-v{KEY_FORMAT_VERSION}",
            f"model={self.model}",
            f"revision={self.revision}",
            f"layout={self.layout.describe()}",
            f"tp={self.tp_rank}/{self.tp_size}",
            f"tenant={self.tenant}",
        ]
        if self.page_format:
            parts.append(f"format={self.page_format}")
        return "\x1f".join(parts)

    @cached_property
    def digest(self) -> bytes:
        """32-byte sha256 of :meth:`describe`; the seed of every key chain in this namespace."""
        return hashlib.sha256(self.describe().encode()).digest()

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def with_tenant(self, tenant: str) -> Namespace:
        return Namespace(self.model, self.layout, self.revision, self.tp_rank, self.tp_size, tenant, self.page_format)


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes; ``ValueError`` for ids outside [0, 2**32)."""
    if isinstance(tokens, (list, tuple)) and _FAST_ARRAY:
        try:
            return array.array("I", tokens).tobytes()
        except (OverflowError, TypeError):
            pass  # fall through to the checked numpy path for a precise message
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a flat sequence of ids, got shape {arr.shape}")
    if arr.size and arr.dtype != np.dtype("<u4"):
        if arr.dtype.kind not in "iu":
            raise ValueError(f"tokens: expected integer ids, got dtype {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            raise ValueError(f"tokens: ids must lie in [0, {MAX_TOKEN_ID}], got min {lo} max {hi}")
    return arr.astype("<u4", copy=False).tobytes()


def page_keys_from_bytes(ns_digest: bytes, token_bytes: bytes, page_size: int, start_key: bytes | None = None,
                         first_page: int = 0) -> list[bytes]:
    """Keys of every *full* page of ``token_bytes`` (uint32 LE), starting at page ``first_page``.

    ``start_key`` is the key of page ``first_page - 1`` (or None to start from the namespace seed);
    it lets a caller extend a chain it already has without rehashing the prefix.
    """
    stride = page_size * 4
    n_pages = len(token_bytes) // stride
    prev = ns_digest if start_key is None else start_key
    view = memoryview(token_bytes)
    sha = hashlib.sha256
    out: list[bytes] = []
    append = out.append
    for off in range(first_page * stride, n_pages * stride, stride):
        prev = sha(prev + view[off : off + stride]).digest()
        append(prev)
    return out


def page_keys(ns: Namespace, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
    """Keys of every full page of ``tokens`` under ``ns`` (a trailing partial page has no key)."""
    return page_keys_from_bytes(ns.digest, tokens_to_bytes(tokens), ns.page_size)


@dataclass
class KeyChain:
    """Incremental key computation for a growing sequence (multi-turn chat, decode)."""

    ns: Namespace
    keys: list[bytes] = field(default_factory=list)

    def extend(self, tokens: Sequence[int] | np.ndarray) -> list[bytes]:
        """Given the *whole* sequence so far, hash only the pages not hashed yet; return all keys."""
        tb = tokens_to_bytes(tokens)
        start = self.keys[-1] if self.keys else None
        self.keys.extend(page_keys_from_bytes(self.ns.digest, tb, self.ns.page_size, start, len(self.keys)))
        return self.keys
