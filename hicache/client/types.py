"""Typed results of the client calls, converted from the protobuf replies by each type's ``from_pb``:
NamedTuples, except :class:`Stats`, a frozen dataclass (its many counters are read by name)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np

from hicache.layout import KVLayout
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb

_TIERS = {pb.TIER_L1: "l1", pb.TIER_L2: "l2"}
_KINDS = {pb.Event.STORED: "stored", pb.Event.REMOVED: "removed", pb.Event.TIER_CHANGED: "tier",
          pb.Event.SNAPSHOT: "snapshot"}


def _i64(values: object) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


class MatchResult(NamedTuple):
    """A Match reply: the cached prefix of the tokens on each tier, and the request it opened."""

    request_id: str  # names the open request in later calls ("" for a peek)
    l1_pages: int  # prefix pages on L1 (after load=True: including the loaded L2 run)
    l2_pages: int  # pages continuing it on L2
    l3_pages: int  # pages continuing that on L3
    page_size: int
    num_pages: int  # full pages in the tokens
    device_indices: np.ndarray  # int64 L1 page of each prefix page, in order
    page_keys: list[bytes]  # when asked for: every full page's key

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV the caller can read from L1 now."""
        return self.l1_pages * self.page_size

    @classmethod
    def from_pb(cls, m: pb.MatchResponse) -> MatchResult:
        """Convert a ``MatchResponse`` (``device_indices`` as an int64 array; empty for a peek)."""
        return cls(m.request_id, m.l1_pages, m.l2_pages, m.l3_pages, m.page_size, m.num_pages,
                   _i64(m.device_indices), list(m.page_keys))


class PrefetchProgress(NamedTuple):
    """One Prefetch message: how far the L3 -> L2 fetch is; the last (``done``) one also carries the L1
    prefix after the L2 -> L1 load."""

    pages_total: int  # pages of the L3 run being fetched (0: none worth fetching)
    pages_done: int  # landed in L2 so far
    done: bool  # last message: the load onto L1 has finished
    device_indices: np.ndarray  # (done only) the request's usable prefix on L1
    loaded_l2_pages: int  # (done only) pages loaded L2 -> L1
    loaded_l3_pages: int  # (done only) of which came from L3

    @classmethod
    def from_pb(cls, m: pb.PrefetchProgress) -> PrefetchProgress:
        """Convert a ``PrefetchProgress`` message (``device_indices`` as an int64 array)."""
        return cls(m.pages_total, m.pages_done, m.done, _i64(m.device_indices), m.loaded_l2_pages,
                   m.loaded_l3_pages)


class CommitResult(NamedTuple):
    """A Commit (or WritePages) reply."""

    new_pages: int  # pages newly cached on L1
    reused_pages: int  # pages the server already had (the request's copies were freed)
    backed_up_pages: int  # pages whose L2 backup started
    device_indices: np.ndarray  # the request's prefix on L1 after the commit

    @classmethod
    def from_pb(cls, m: pb.CommitResponse) -> CommitResult:
        """Convert a ``CommitResponse`` (``device_indices`` as an int64 array)."""
        return cls(m.new_pages, m.reused_pages, m.backed_up_pages, _i64(m.device_indices))


class PageRun(NamedTuple):
    """A run of consecutive pages of one namespace (one radix node's pages) in an :class:`Event`."""

    namespace_digest: bytes  # 32 bytes: the seed of the namespace's key chain
    parent_key: bytes  # b"" when the run starts the sequence
    page_keys: list[bytes]  # one key per page, in order
    tokens: np.ndarray  # uint32 token ids of the run
    tiers: tuple[str, ...]  # ("l1",), ("l2",), ("l1", "l2") or () after removal; see Event.from_pb


class Event(NamedTuple):
    """One WatchEvents message: a run stored, removed or changing tier, or (part of) a snapshot."""

    sequence: int  # gap-free per server run; a snapshot's is the last event it reflects
    kind: str  # stored | removed | tier | snapshot
    runs: list[PageRun]  # one run, or every run of this snapshot part
    server_id: str  # changes on restart
    snapshot_continues: bool  # a split snapshot: more parts with the same sequence follow

    @classmethod
    def from_pb(cls, m: pb.Event) -> Event:
        """Convert an ``Event`` message: kind and tiers as strings, tokens as a uint32 array.

        A kind this client does not know reads ``"unknown"``, and so does a tier value it does not know
        (a newer server's). ``TIER_UNSPECIFIED`` (0, proto3's default) names no tier and is skipped:
        servers never send it, and ``tiers`` lists only the tiers that hold the run.
        """
        runs = [PageRun(r.namespace_digest, r.parent_key, list(r.page_keys), np.frombuffer(r.tokens, dtype="<u4"),
                        tuple(_TIERS.get(t, "unknown") for t in r.tiers if t != pb.TIER_UNSPECIFIED))
                for r in m.runs]
        return cls(m.sequence, _KINDS.get(m.kind, "unknown"), runs, m.server_id, m.snapshot_continues)


class FlushResult(NamedTuple):
    """What the node's store had not taken when a ``flush`` ended (all zero and ``complete``: nothing)."""

    has_storage: bool  # False: the node has no L3 store; only its backups in flight were waited for
    written_pages: int  # stored since the node started
    failed_pages: int  # the store refused or errored on
    dropped_pages: int  # refused on a full write queue
    pending_pages: int  # still queued when the wait ended (the deadline came first)
    complete: bool  # nothing failed, dropped or pending: everything ever queued is in the store

    @classmethod
    def from_pb(cls, m: pb.FlushResponse) -> FlushResult:
        """Convert a ``FlushResponse``."""
        return cls(bool(m.has_storage), int(m.written_pages), int(m.failed_pages), int(m.dropped_pages),
                   int(m.pending_pages), bool(m.complete))


class ClearResult(NamedTuple):
    """Pages a node's ``clear`` freed."""

    l1_pages: int  # pages freed on L1
    l2_pages: int  # pages freed on L2

    @classmethod
    def from_pb(cls, m: pb.ClearResponse) -> ClearResult:
        """Convert a ``ClearResponse``."""
        return cls(int(m.l1_pages), int(m.l2_pages))


class PinInfo(NamedTuple):
    """A prefix pinned on the node (``pin``): its pages there stay on their tiers until ``unpin``."""

    pin_id: int  # the node's id for the pin (``unpin`` takes it)
    l1_pages: int  # leading pages kept on L1
    l2_pages: int  # pages continuing them, kept on L2
    namespace: str  # the namespace the pin is in (model, revision, tenant, layout)

    @classmethod
    def from_pb(cls, m: pb.PinInfo) -> PinInfo:
        """Convert a ``PinInfo`` message."""
        return cls(int(m.pin_id), int(m.l1_pages), int(m.l2_pages), str(m.namespace))


@dataclass(frozen=True)
class Stats:
    """A Stats reply: a node's pools and counters now; the counters run from the node's start."""

    l1_pages_total: int  # pages of the L1 pool
    l1_pages_used: int  # allocated: cached, or owned by open requests
    l1_pages_cached: int  # held by the tree
    l1_pages_locked: int  # in locked tree nodes (open requests, pins, backups in flight): not evictable
    l2_pages_total: int  # pages of the L2 pool (0: no L2)
    l2_pages_used: int  # allocated: cached, or taken by prefetches from L3 in flight
    l2_pages_cached: int  # held by the tree
    writeback_queue_pages: int  # queued for writing to L3
    lookups: int  # matches that opened a request (ReadPages included; peeks and peers' WritePages not)
    lookup_tokens: int  # tokens of the full pages looked up
    hit_tokens_l1: int  # tokens found on L1
    hit_tokens_l2: int  # tokens continuing them on L2 and served from it (loaded back onto L1 for the request)
    hit_tokens_l3: int  # tokens continuing those on L3 and served from it (prefetched and loaded back)
    open_requests: int  # requests opened by Match and not released yet
    event_sequence: int  # sequence number of the last event emitted
    storage_pages_written: int  # pages the L3 store took (0 without a store)
    storage_pages_read: int  # pages read back from L3
    storage_errors: int  # store failures (per page for files, per operation for Redis)
    storage_corrupt_pages: int  # L3 pages that failed verification (counted as misses)
    pins: int  # prefixes pinned (Pin)
    pinned_l1_pages: int  # pages the pins hold on L1 (overlapping pins count each time)
    pinned_l2_pages: int  # pages the pins hold on L2 (likewise)
    storage_bytes_written: int = 0  # page bytes the L3 store took
    storage_stored_bytes_written: int = 0  # the same pages as stored (storage.compression)

    @property
    def storage_compression_ratio(self) -> float:
        """Page bytes written to L3 over the bytes stored for them (1.0: stored as they are, or none yet)."""
        if not self.storage_stored_bytes_written:
            return 1.0
        return self.storage_bytes_written / self.storage_stored_bytes_written

    @property
    def hit_rate(self) -> float:
        """Tokens hit on any tier over tokens looked up."""
        hits = self.hit_tokens_l1 + self.hit_tokens_l2 + self.hit_tokens_l3
        return hits / self.lookup_tokens if self.lookup_tokens else 0.0

    @classmethod
    def from_pb(cls, m: pb.StatsResponse) -> Stats:
        """Convert a ``StatsResponse`` (every field by name)."""
        return cls(**{f.name: int(getattr(m, f.name)) for f in fields(cls)})


class PoolInfo(NamedTuple):
    """A GetPoolInfo or Attach reply: the node's KV layout, L1 pool and model shard."""

    layout: KVLayout
    num_pages: int  # L1 pages
    device: str  # the L1 pool's device: cpu | cuda | cuda:N
    model: str
    revision: str  # the model's weights revision
    tp_rank: int
    tp_size: int
    namespace_digest: bytes  # the default tenant's namespace digest (seed of its key chain)
    handle_kind: str  # "shm" | "cuda_ipc" | "" (GetPoolInfo, or a pool that is not shared)
    hostname: str
    raw: pb.PoolInfo  # the message (carries the handle)

    @classmethod
    def from_pb(cls, m: pb.PoolInfo) -> PoolInfo:
        """Convert a ``PoolInfo`` message; the handle, if any, stays in ``raw``."""
        lay = m.layout
        layout = KVLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype, lay.page_size,
                          lay.attention)  # type: ignore[arg-type]
        return cls(layout, m.num_pages, m.device, m.model, m.revision, m.tp_rank, m.tp_size, m.namespace_digest,
                   m.WhichOneof("handle") or "", m.hostname, m)
