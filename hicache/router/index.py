"""The router's global index: page key -> {node: tiers}, fed by every node's event stream.

Each node's WatchEvents stream starts with a SNAPSHOT (possibly split over several messages) and then
carries STORED / REMOVED / TIER_CHANGED events numbered ``snapshot.sequence + 1, + 2, ...`` (gap-free
per server run; ``server_id`` changes when the node restarts). :meth:`KVIndex.apply` enforces that
contract per node and answers what the feed must do next:

* ``APPLIED`` / ``IGNORED`` (a duplicate: a delta, or a snapshot part while in sync, whose sequence
  is already applied): keep reading;
* ``RESYNC``: a sequence gap, a delta before any snapshot, a delta from another server run or a
  snapshot interleaved with deltas. The node's entries have been dropped already (never route on a
  state known to be incomplete); the feed reconnects and the new stream's snapshot rebuilds them.

A completed snapshot *replaces* everything known about the node, so missed removals cannot linger.
Snapshot parts are staged and applied at once on the last part, so a half-received snapshot is never
visible to :meth:`match`. A router that restarts simply rebuilds from each node's first snapshot.

With ``verify_keys`` every stored run's keys are recomputed from its parent key and tokens (the chain of
:mod:`hicache.keys`); a run whose keys do not follow from its tokens is refused and counted (a node with
a broken key function would otherwise attract requests it can never serve from cache).

Keys are chained, so "the node holds the first n keys of the request" is "the node's cached prefix is n
pages". :meth:`match` walks the request's keys once for all nodes and follows the node service's own
match rule: the L1 run from the start, then the L2 run continuing it.

Single-threaded by contract: the router calls everything here from its event loop.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from hicache.client.types import Event, PageRun

L1 = 1  # tier bits of a key's mask
L2 = 2
_TIER_BITS = {"l1": L1, "l2": L2}


class Applied(enum.Enum):
    APPLIED = "applied"
    IGNORED = "ignored"  # duplicate (sequence already applied) or a snapshot part still being staged
    RESYNC = "resync"  # the node's state was dropped: reconnect to get a fresh snapshot


class PrefixMatch(NamedTuple):
    l1_pages: int  # pages of the request's prefix on the node's L1
    l2_pages: int  # pages continuing that run on the node's L2

    @property
    def pages(self) -> int:
        return self.l1_pages + self.l2_pages


NO_MATCH = PrefixMatch(0, 0)


@dataclass
class FeedState:
    """Where one node's event stream stands."""

    server_id: str = ""  # the node's run id of the last snapshot applied ("" before any)
    sequence: int = 0  # last event applied (a snapshot counts as its sequence)
    synced: bool = False  # a snapshot was applied and no gap seen since
    snapshots: int = 0  # snapshots applied (the first, then one per resync)
    gaps: int = 0  # resyncs caused by the stream itself (gap, out-of-order kind, other server)
    bad_runs: int = 0  # runs refused because their keys do not follow from their tokens
    events: int = 0  # deltas applied
    staging: list[PageRun] | None = None  # parts of a snapshot being received
    staging_seq: int = 0
    staging_server: str = ""
    pages: dict[bytes, int] = field(default_factory=dict)  # this node's keys -> tier mask


def tier_mask(tiers: Iterable[str]) -> int:
    m = 0
    for t in tiers:
        m |= _TIER_BITS.get(t, 0)
    return m


def run_keys_ok(run: PageRun, page_size: int) -> bool:
    """True when ``run.page_keys`` is the key chain of ``run.tokens`` after ``run.parent_key``."""
    tb = run.tokens.astype("<u4", copy=False).tobytes()
    stride = page_size * 4
    if len(tb) != stride * len(run.page_keys):
        return False
    prev = run.parent_key or run.namespace_digest
    view = memoryview(tb)
    for i, key in enumerate(run.page_keys):
        prev = hashlib.sha256(prev + view[i * stride:(i + 1) * stride]).digest()
        if prev != key:
            return False
    return True


class KVIndex:
    """Which node holds which page key, on which tier."""

    def __init__(self, page_size: int, verify_keys: bool = True) -> None:
        self.page_size = page_size
        self.verify_keys = verify_keys
        self._holders: dict[bytes, dict[str, int]] = {}  # key -> {node: tier mask}
        self._feeds: dict[str, FeedState] = {}

    # ------------------------------------------------------------------ nodes
    def feed(self, node: str) -> FeedState:
        st = self._feeds.get(node)
        if st is None:
            st = self._feeds[node] = FeedState()
        return st

    def drop(self, node: str) -> None:
        """Forget everything about ``node`` (it disconnected: its state is unknown until the next snapshot)."""
        st = self.feed(node)
        self._clear(node, st)
        st.synced = False
        st.staging = None

    def _clear(self, node: str, st: FeedState) -> None:
        holders = self._holders
        for key in st.pages:
            h = holders.get(key)
            if h is not None:
                h.pop(node, None)
                if not h:
                    del holders[key]
        st.pages = {}

    def set_page(self, node: str, st: FeedState, key: bytes, mask: int) -> None:
        """Record that ``node`` (whose feed state is ``st``) holds ``key`` on the tiers of ``mask``; 0 forgets
        it. The event feed's one write path, and the approximate index's (:mod:`hicache.router.approx`)."""
        if mask:
            st.pages[key] = mask
            h = self._holders.get(key)
            if h is None:
                self._holders[key] = {node: mask}
            else:
                h[node] = mask
        elif st.pages.pop(key, None) is not None:
            h = self._holders.get(key)
            if h is not None:
                h.pop(node, None)
                if not h:
                    del self._holders[key]

    def _apply_run(self, node: str, st: FeedState, run: PageRun, mask: int) -> None:
        if mask and self.verify_keys and not run_keys_ok(run, self.page_size):
            st.bad_runs += 1
            return
        for key in run.page_keys:
            self.set_page(node, st, key, mask)

    # ------------------------------------------------------------------ events
    def apply(self, node: str, ev: Event) -> Applied:
        """Apply one message of ``node``'s WatchEvents stream (see the module docstring)."""
        st = self.feed(node)
        if ev.kind == "snapshot":
            return self._snapshot_part(node, st, ev)
        if st.staging is not None or not st.synced or ev.server_id != st.server_id:
            return self._resync(node, st)
        if ev.sequence <= st.sequence:
            return Applied.IGNORED
        if ev.sequence != st.sequence + 1:
            return self._resync(node, st)
        if ev.kind not in ("stored", "removed", "tier"):
            return self._resync(node, st)
        for run in ev.runs:
            self._apply_run(node, st, run, 0 if ev.kind == "removed" else tier_mask(run.tiers))
        st.sequence = ev.sequence
        st.events += 1
        return Applied.APPLIED

    def _resync(self, node: str, st: FeedState) -> Applied:
        st.gaps += 1
        self.drop(node)
        return Applied.RESYNC

    def _snapshot_part(self, node: str, st: FeedState, ev: Event) -> Applied:
        if st.staging is not None and (ev.sequence != st.staging_seq or ev.server_id != st.staging_server):
            return self._resync(node, st)  # a new snapshot began before the last one finished
        if st.staging is None and st.synced and ev.server_id == st.server_id and ev.sequence <= st.sequence:
            # A repeated part (or an older snapshot) of this run: that state is applied already, and a lone
            # part, taken for a whole snapshot, would replace the node's pages with a fraction of them.
            return Applied.IGNORED
        if st.staging is None:
            st.staging, st.staging_seq, st.staging_server = [], ev.sequence, ev.server_id
        st.staging.extend(ev.runs)
        if ev.snapshot_continues:
            return Applied.IGNORED
        runs, st.staging = st.staging, None
        self._clear(node, st)
        for run in runs:
            self._apply_run(node, st, run, tier_mask(run.tiers))
        st.server_id, st.sequence, st.synced = ev.server_id, ev.sequence, True
        st.snapshots += 1
        return Applied.APPLIED

    # ------------------------------------------------------------------ lookups
    def holders(self, key: bytes) -> dict[str, int]:
        """{node: tier mask} for one page key (empty when no node holds it)."""
        return dict(self._holders.get(key, {}))

    def match(self, keys: Sequence[bytes]) -> dict[str, PrefixMatch]:
        """Per node holding ``keys[0]``: its L1 run from the start and the L2 run continuing it."""
        if not keys:
            return {}
        first = self._holders.get(keys[0])
        if not first:
            return {}
        l1 = dict.fromkeys(first, 0)
        l2 = dict.fromkeys(first, 0)
        alive = list(first)
        for key in keys:
            h = self._holders.get(key)
            if not h:
                break
            still = []
            for n in alive:
                m = h.get(n, 0)
                if m & L1 and not l2[n]:
                    l1[n] += 1
                elif m & L2:
                    l2[n] += 1
                else:
                    continue
                still.append(n)
            alive = still
            if not alive:
                break
        return {n: PrefixMatch(l1[n], l2[n]) for n in first}

    def tier_pages(self, node: str) -> tuple[int, int]:
        """(pages indexed on the node's L1, on its L2)."""
        a = b = 0
        for m in self.feed(node).pages.values():
            a += m & L1
            b += (m & L2) >> 1
        return a, b

    def __len__(self) -> int:
        return len(self._holders)
