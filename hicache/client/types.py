"""Typed results of the client calls (NamedTuples over the protobuf messages)."""

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
        return cls(m.request_id, m.l1_pages, m.l2_pages, m.l3_pages, m.page_size, m.num_pages,
                   _i64(m.device_indices), list(m.page_keys))


class PrefetchProgress(NamedTuple):
    pages_total: int  # pages of the L3 run being fetched (0: none worth fetching)
    pages_done: int  # landed in L2 so far
    done: bool  # last message: the load onto L1 has finished
    device_indices: np.ndarray  # (done only) the request's usable prefix on L1
    loaded_l2_pages: int  # (done only) pages loaded L2 -> L1
    loaded_l3_pages: int  # (done only) of which came from L3

    @classmethod
    def from_pb(cls, m: pb.PrefetchProgress) -> PrefetchProgress:
        return cls(m.pages_total, m.pages_done, m.done, _i64(m.device_indices), m.loaded_l2_pages,
                   m.loaded_l3_pages)


class CommitResult(NamedTuple):
    new_pages: int  # pages newly cached on L1
    reused_pages: int  # pages the server already had (the request's copies were freed)
    backed_up_pages: int  # pages whose L2 backup started
    device_indices: np.ndarray  # the request's prefix on L1 after the commit

    @classmethod
    def from_pb(cls, m: pb.CommitResponse) -> CommitResult:
        return cls(m.new_pages, m.reused_pages, m.backed_up_pages, _i64(m.device_indices))


class PageRun(NamedTuple):
    namespace_digest: bytes
    parent_key: bytes  # b"" when the run starts the sequence
    page_keys: list[bytes]
    tokens: np.ndarray  # uint32 token ids of the run
    tiers: tuple[str, ...]  # ("l1",), ("l2",), ("l1", "l2") or () after removal


class Event(NamedTuple):
    sequence: int  # gap-free per server run; a snapshot's is the last event it reflects
    kind: str  # stored | removed | tier | snapshot
    runs: list[PageRun]
    server_id: str  # changes on restart
    snapshot_continues: bool  # a split snapshot: more parts with the same sequence follow

    @classmethod
    def from_pb(cls, m: pb.Event) -> Event:
        runs = [PageRun(r.namespace_digest, r.parent_key, list(r.page_keys), np.frombuffer(r.tokens, dtype="<u4"),
                        tuple(_TIERS[t] for t in r.tiers)) for r in m.runs]
        return cls(m.sequence, _KINDS.get(m.kind, "unknown"), runs, m.server_id, m.snapshot_continues)


class FlushResult(NamedTuple):
    """What the node's store had not taken when a ``flush`` ended (all zero and ``complete``: nothing)."""

    has_storage: bool  # False: the node has no L3 store; only its backups in flight were waited for
    written_pages: int  # stored since the node started
    failed_pages: int  # the store refused or errored on
    dropped_pages: int  # refused on a full write queue
    pending_pages: int  # still queued when the wait ended (the deadline came first)
    complete: bool

    @classmethod
    def from_pb(cls, m: pb.FlushResponse) -> FlushResult:
        return cls(bool(m.has_storage), int(m.written_pages), int(m.failed_pages), int(m.dropped_pages),
                   int(m.pending_pages), bool(m.complete))


class ClearResult(NamedTuple):
    """Pages a node's ``clear`` freed."""

    l1_pages: int
    l2_pages: int

    @classmethod
    def from_pb(cls, m: pb.ClearResponse) -> ClearResult:
        return cls(int(m.l1_pages), int(m.l2_pages))


class PinInfo(NamedTuple):
    """A prefix pinned on the node (``pin``): its pages there stay on their tiers until ``unpin``."""

    pin_id: int
    l1_pages: int  # leading pages kept on L1
    l2_pages: int  # pages continuing them, kept on L2
    namespace: str

    @classmethod
    def from_pb(cls, m: pb.PinInfo) -> PinInfo:
        return cls(int(m.pin_id), int(m.l1_pages), int(m.l2_pages), str(m.namespace))


@dataclass(frozen=True)
class Stats:
    l1_pages_total: int
    l1_pages_used: int
    l1_pages_cached: int
    l1_pages_locked: int
    l2_pages_total: int
    l2_pages_used: int
    l2_pages_cached: int
    writeback_queue_pages: int
    lookups: int
    lookup_tokens: int
    hit_tokens_l1: int
    hit_tokens_l2: int
    hit_tokens_l3: int
    open_requests: int
    event_sequence: int
    storage_pages_written: int
    storage_pages_read: int
    storage_errors: int
    storage_corrupt_pages: int
    pins: int
    pinned_l1_pages: int
    pinned_l2_pages: int

    @property
    def hit_rate(self) -> float:
        """Tokens hit on any tier over tokens looked up."""
        hits = self.hit_tokens_l1 + self.hit_tokens_l2 + self.hit_tokens_l3
        return hits / self.lookup_tokens if self.lookup_tokens else 0.0

    @classmethod
    def from_pb(cls, m: pb.StatsResponse) -> Stats:
        return cls(**{f.name: int(getattr(m, f.name)) for f in fields(cls)})


class PoolInfo(NamedTuple):
    layout: KVLayout
    num_pages: int  # L1 pages
    device: str
    model: str
    revision: str
    tp_rank: int
    tp_size: int
    namespace_digest: bytes
    handle_kind: str  # "shm" | "cuda_ipc" | "" (GetPoolInfo, or a pool that is not shared)
    hostname: str
    raw: pb.PoolInfo  # the message (carries the handle)

    @classmethod
    def from_pb(cls, m: pb.PoolInfo) -> PoolInfo:
        lay = m.layout
        layout = KVLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype, lay.page_size,
                          lay.attention)  # type: ignore[arg-type]
        return cls(layout, m.num_pages, m.device, m.model, m.revision, m.tp_rank, m.tp_size, m.namespace_digest,
                   m.WhichOneof("handle") or "", m.hostname, m)
