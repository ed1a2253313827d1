"""What :class:`hicache.cache.HiCache` hands its callers: a request's state between match and release,
the results of its calls, and the error of a full cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from hicache.accounting import L2Tally, L3Tally
from hicache.keys import Namespace
from hicache.radix_types import TreeNode
from hicache.storage.prefetch import PrefetchTask
from hicache.transfer import TransferHandle


class CacheFullError(RuntimeError):
    """Not enough free or evictable pages (everything is locked by requests in flight), or a pin would
    take more than ``cache.max_pinned_fraction`` of a tier."""


@dataclass
class Request:
    """State of one request between match and release (returned by :meth:`HiCache.match`)."""

    ns: Namespace
    token_bytes: bytes  # tokens of the full pages, uint32 LE
    keys: list[bytes]  # page key of every full page (empty when matched with keys=False and no L3 lookup)
    l1_pages: int  # pages hit on L1 (locked; some may still be loading for another request: ``pending``)
    l2_pages: int  # pages continuing it on L2
    l3_pages: int  # pages continuing that on L3 (0 without a store)
    device_indices: np.ndarray  # L1 pages of the usable prefix, in order (grows after load_back)
    lock_node: TreeNode | None = None  # deepest L1 node locked for this request
    pin_node: TreeNode | None = None  # deepest L2 node pinned for this request
    host_nodes: list[TreeNode] = field(default_factory=list)
    pending: list[Any] = field(default_factory=list)  # loads the L1 prefix still depends on
    owned_device: list[np.ndarray] = field(default_factory=list)  # allocated, not committed yet
    prefetch: PrefetchTask | None = None
    prefetched: bool = False  # a prefetch was started for it (at most one per request)
    prefetch_start: int = 0  # the page its prefetch starts at
    l2: L2Tally | None = None  # what became of its L2 run, until counted (its load back, commit or release)
    l3: L3Tally | None = None  # what became of its L3 run, until counted (load back of its prefetch, release)
    uncounted: float | None = None  # matched with defer_count: the match's seconds, until count_match
    released: bool = False

    @property
    def page_size(self) -> int:
        return self.ns.page_size

    @property
    def num_pages(self) -> int:
        return len(self.token_bytes) // (self.ns.page_size * 4)

    @property
    def hit_pages(self) -> int:
        return self.l1_pages + self.l2_pages + self.l3_pages

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV is on L1 now (after load_back: including the loaded L2/L3 run)."""
        return len(self.device_indices) * self.page_size


class PinInfo(NamedTuple):
    """A pinned prefix (:meth:`HiCache.pin`)."""

    pin_id: int
    l1_pages: int  # leading pages kept on L1
    l2_pages: int  # pages continuing them, kept on L2
    namespace: str  # the namespace's description (model, revision, tenant, layout)


class LoadResult(NamedTuple):
    handle: TransferHandle | None  # per-layer readiness of every load the prefix depends on (others' earlier
    # loads and this one); None when none is pending
    device_indices: np.ndarray  # L1 pages of the whole usable prefix, in order
    l2_pages: int  # pages loaded from L2
    l3_pages: int  # pages of the prefix the request's prefetch brought from L3 (landed, and usable now)

    def wait_layer(self, layer: int) -> None:
        if self.handle is not None:
            self.handle.wait_layer(layer)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()


class CommitResult(NamedTuple):
    new_pages: int  # pages newly cached on L1
    reused_pages: int  # pages the tree already had (the caller's copies were freed)
    backed_up_pages: int  # pages whose L2 backup started now


class MultiHandle(TransferHandle):
    """Readiness of several loads the prefix depends on (earlier loads by other requests + ours)."""

    def __init__(self, handles: list[TransferHandle]) -> None:
        self._handles = handles
        self.num_layers = handles[0].num_layers
        self.num_pages = sum(h.num_pages for h in handles)

    def wait_layer(self, layer: int) -> None:
        for h in self._handles:
            h.wait_layer(layer)

    def wait(self) -> None:
        for h in self._handles:
            h.wait()

    def done(self) -> bool:
        return all(h.done() for h in self._handles)
