"""WatchEvents: a snapshot, then stored / tier / removed events with gap-free sequence numbers; a
subscriber that falls behind gets a fresh snapshot instead of a silent gap."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from hicache.cache import HiCache
from hicache.client import Event, HiCacheClient
from hicache.keys import page_keys
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.service.events import EventHub

from .service_harness import ServerProc

PS = 16


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, pages * PS).astype(np.uint32)


def commit(c: HiCacheClient, toks: np.ndarray, rid: str) -> None:
    m = c.match(toks, rid)
    new = c.allocate(rid, m.num_pages - m.l1_pages)
    c.commit(rid, toks, np.concatenate([m.device_indices, new]))
    c.release(rid)


class Collector:
    """Reads a WatchEvents stream on a thread."""

    def __init__(self, client: HiCacheClient) -> None:
        self.events: list[Event] = []
        self._it = client.watch_events()
        self._cv = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for ev in self._it:
                with self._cv:
                    self.events.append(ev)
                    self._cv.notify_all()
        except grpc.RpcError:  # the channel closed at the end of the test
            pass

    def wait_for(self, pred: Callable[[list[Event]], bool], timeout: float = 10.0) -> list[Event]:
        with self._cv:
            assert self._cv.wait_for(lambda: pred(self.events), timeout), self.events
            return list(self.events)


def test_stored_and_removed_events_are_gap_free(server_factory: Callable[..., ServerProc]) -> None:
    # 8 L1 pages, no L2: committing a third 4-page prompt evicts the oldest, which leaves the tree
    srv = server_factory(cache={"l1_tokens": 8 * PS, "l2_tokens": 0})
    with HiCacheClient(srv.target) as c:
        col = Collector(c)
        first = col.wait_for(lambda evs: len(evs) >= 1)[0]
        assert first.kind == "snapshot" and first.runs == [] and first.sequence == 0
        a, b, d = prompt(1, 4), prompt(2, 4), prompt(3, 4)
        commit(c, a, "a")
        commit(c, b, "b")
        commit(c, d, "d")
        evs = col.wait_for(lambda evs: any(e.kind == "removed" for e in evs) and
                           sum(e.kind == "stored" for e in evs) >= 3)
        seqs = [e.sequence for e in evs[1:]]
        assert seqs == list(range(1, len(seqs) + 1)), seqs  # gap-free, from the snapshot's sequence + 1
        stored = [e for e in evs if e.kind == "stored"]
        ns = next(iter(stored)).runs[0].namespace_digest
        assert stored[0].runs[0].page_keys == [k for k in page_keys_for(srv, a)]
        assert np.array_equal(stored[0].runs[0].tokens, a) and stored[0].runs[0].tiers == ("l1",)
        assert stored[0].runs[0].parent_key == b""
        removed = [e for e in evs if e.kind == "removed"]
        assert removed[0].runs[0].page_keys == stored[0].runs[0].page_keys  # LRU: the first prompt went
        assert removed[0].runs[0].tiers == () and removed[0].runs[0].namespace_digest == ns
        # a late subscriber starts from a snapshot of what is cached now, numbered where the stream stands
        late = next(iter(c.watch_events()))
        assert late.kind == "snapshot" and late.sequence == seqs[-1]
        assert sorted(r.page_keys[0] for r in late.runs) == sorted(
            e.runs[0].page_keys[0] for e in stored[1:])


def page_keys_for(srv: ServerProc, toks: np.ndarray) -> list[bytes]:
    from hicache.config import config_from_dict

    return page_keys(config_from_dict(srv.config).namespace(), toks)


def test_fallen_behind_subscriber_gets_a_new_snapshot(make_cache: Callable[..., HiCache]) -> None:
    cache = make_cache()

    async def main() -> list[pb.Event]:
        hub = EventHub(asyncio.get_running_loop(), "t")
        cache.add_listener(hub.on_tree_event)
        stream = hub.stream(cache.snapshot, max_queue=2)
        out: list[pb.Event] = [await anext(stream)]  # snapshot of the empty tree
        ps = cache.page_size
        for i in range(5):  # 5 events while the subscriber does not read: its queue (2) overflows
            toks = np.arange(i * 1000, i * 1000 + 2 * ps)
            req = cache.match(toks)
            cache.commit(req, toks, cache.alloc(req, 2))
            cache.release(req)
        await asyncio.sleep(0.05)  # let the loop deliver them
        out.append(await anext(stream))
        toks = np.arange(9000, 9000 + ps)
        req = cache.match(toks)
        cache.commit(req, toks, cache.alloc(req, 1))
        cache.release(req)
        await asyncio.sleep(0.05)
        out.append(await anext(stream))
        await stream.aclose()
        cache.remove_listener(hub.on_tree_event)
        return out

    snap0, snap1, ev = asyncio.run(main())
    assert snap0.kind == pb.Event.SNAPSHOT and snap0.sequence == 0
    assert snap1.kind == pb.Event.SNAPSHOT and snap1.sequence >= 5  # resync instead of a gap
    assert len(snap1.runs) == 5
    assert ev.kind == pb.Event.STORED and ev.sequence == snap1.sequence + 1


def test_snapshot_is_split_and_ordered(make_cache: Callable[..., HiCache], monkeypatch: Any) -> None:
    import hicache.service.events as events

    monkeypatch.setattr(events, "SNAPSHOT_RUNS_PER_MESSAGE", 2)
    cache = make_cache()
    for i in range(5):
        toks = np.arange(i * 1000, i * 1000 + cache.page_size)
        req = cache.match(toks)
        cache.commit(req, toks, cache.alloc(req, 1))
        cache.release(req)

    async def main() -> list[pb.Event]:
        hub = EventHub(asyncio.get_running_loop(), "t")
        cache.add_listener(hub.on_tree_event)
        stream = hub.stream(cache.snapshot, max_queue=8)
        parts = [await anext(stream) for _ in range(3)]
        await stream.aclose()
        return parts

    parts = asyncio.run(main())
    assert [p.snapshot_continues for p in parts] == [True, True, False]
    assert sum(len(p.runs) for p in parts) == 5 and len({p.sequence for p in parts}) == 1



def test_event_tiers_skip_unspecified_and_name_unknown_values() -> None:
    """TIER_UNSPECIFIED names no tier (proto3's default; servers never send it): it is left out. A tier
    value this client does not know (a newer server's) reads "unknown", as an unknown kind does."""
    run = pb.PageRun(namespace_digest=b"d" * 32, page_keys=[b"k"], tokens=np.arange(PS, dtype="<u4").tobytes(),
                     tiers=[pb.TIER_UNSPECIFIED, pb.TIER_L1, pb.TIER_L2])
    ev = Event.from_pb(pb.Event(sequence=3, kind=pb.Event.STORED, runs=[run], server_id="s"))
    assert ev.kind == "stored" and ev.runs[0].tiers == ("l1", "l2")
    only = pb.PageRun(tiers=[pb.TIER_UNSPECIFIED])
    assert Event.from_pb(pb.Event(kind=pb.Event.TIER_CHANGED, runs=[only])).runs[0].tiers == ()
    newer = pb.Event.FromString(pb.Event(kind=7, runs=[pb.PageRun(tiers=[pb.TIER_L1, 5])]).SerializeToString())
    ev = Event.from_pb(newer)
    assert ev.kind == "unknown" and ev.runs[0].tiers == ("l1", "unknown")
