"""Stateful property test: the router's index, fed each node's event stream, agrees with what the nodes hold.

The model is the nodes: per node its run (``server_id``, restarting at sequence 0), the tier mask of every
page key it holds (two namespaces, four documents sharing prefixes) and its state after each event of the
run. Rules change a node's pages as a node does (store on L1 / L2 / both, L1 -> L2 demotion, eviction,
Clear), each change one gap-free numbered event built as the node's event hub builds it
(``hicache.service.events.page_run``) and sent through the wire format (``Event.from_pb`` of the
serialized message). A node's open stream is a queue of messages not delivered yet: it starts with a
snapshot of the node (split into parts of a few runs), then carries every later event. Messages arrive
late (delivered when a rule says), twice (right away, or again after later ones), out of order, with
one missing (a gap), after the node's hub fell behind (queued events dropped, a fresh snapshot follows),
or from another server run; nodes disconnect, restart empty under a new server id or are down a while;
the router itself restarts with an empty index. Delivery goes through :meth:`Router.apply_event` and the
feed's reactions (RESYNC or a broken stream: the node's pages are dropped and a new stream opens with a
snapshot), as :class:`NodeFeed` does.

Checked after every step: a node whose feed is in sync is indexed exactly as the node was after the last
event applied (never a state the node was not in), one not in sync has nothing indexed; the index's key
map mirrors the per-node maps (no dead entry: its size is the number of distinct keys held). Once every
stream has settled (all delivered, resyncs done): each node is indexed exactly as it is now, and for
every query (each document and a prefix of it, per namespace) the index's longest prefix per node and
tier, the scores a peek Route reports and ListNodes' page counts all equal the model's.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from router_helpers import PS, node_config, router_config, tokens

from hicache.client.types import Event
from hicache.keys import page_keys
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.radix_types import TreeEvent
from hicache.router.core import Router
from hicache.router.index import L1, L2, Applied, PrefixMatch
from hicache.service.events import page_run

CONFIG = node_config()
NAMESPACES = [CONFIG.namespace(), CONFIG.namespace().with_tenant("acme")]
TENANTS = ["", "acme"]
_BASE = tokens(1, 6)
DOCS = [
    _BASE,
    np.concatenate([_BASE[:2 * PS], tokens(2, 3)]),  # shares 2 pages with doc 0
    tokens(3, 4),
    np.concatenate([_BASE[:4 * PS], tokens(4, 2)]),  # shares 4 pages with doc 0
]
NODES = ("a", "b", "c")
KINDS = {"stored": pb.Event.STORED, "removed": pb.Event.REMOVED, "tier": pb.Event.TIER_CHANGED,
         "snapshot": pb.Event.SNAPSHOT}

L2_WEIGHT = router_config(NODES).scoring.l2_weight
KEYS = [[page_keys(ns, d) for d in DOCS] for ns in NAMESPACES]  # KEYS[ns][doc][page]


@dataclass(frozen=True)
class PageInfo:
    ns: bytes
    parent: bytes
    tokens: bytes


INFO: dict[bytes, PageInfo] = {}
for _n, _ns in enumerate(NAMESPACES):
    for _d, _doc in enumerate(DOCS):
        _keys = KEYS[_n][_d]
        for _p, _k in enumerate(_keys):
            INFO[_k] = PageInfo(_ns.digest, _keys[_p - 1] if _p else b"",
                                _doc[_p * PS:(_p + 1) * PS].astype("<u4").tobytes())

Pages = dict[bytes, int]  # page key -> tier mask


def wire(seq: int, kind: str, runs: list[pb.PageRun], server: str, more: bool = False) -> Event:
    """The message as the router's client reads it off the stream."""
    m = pb.Event(sequence=seq, kind=KINDS[kind], runs=runs, server_id=server, snapshot_continues=more)
    return Event.from_pb(pb.Event.FromString(m.SerializeToString()))


def run_of(ns: int, doc: int, a: int, b: int, mask: int, kind: str) -> pb.PageRun:
    keys = KEYS[ns][doc]
    toks = DOCS[doc][a * PS:b * PS].astype("<u4").tobytes()
    return page_run(TreeEvent(kind, NAMESPACES[ns].digest, keys[a - 1] if a else b"", tuple(keys[a:b]), toks,
                              bool(mask & L1), bool(mask & L2)))


def page_of(key: bytes, mask: int) -> pb.PageRun:
    i = INFO[key]
    return page_run(TreeEvent("stored", i.ns, i.parent, (key,), i.tokens, bool(mask & L1), bool(mask & L2)))


def expected_match(pages: Pages, keys: list[bytes]) -> PrefixMatch:
    """The node's own rule: the L1 run from the first page, then the L2 run continuing it."""
    l1 = l2 = 0
    for k in keys:
        m = pages.get(k, 0)
        if m & L1 and not l2:
            l1 += 1
        elif m & L2:
            l2 += 1
        else:
            break
    return PrefixMatch(l1, l2)


@dataclass
class Node:
    name: str
    runs: int = 0  # server runs so far
    server_id: str = ""
    seq: int = 0
    up: bool = True
    pages: Pages = field(default_factory=dict)
    history: dict[int, Pages] = field(default_factory=dict)  # state after each event of this run
    stream: collections.deque[Event] | None = None  # messages of the open stream not delivered yet
    sent: collections.deque[Event] = field(default_factory=lambda: collections.deque(maxlen=8))  # ... delivered

    def start(self) -> None:
        self.runs += 1
        self.server_id, self.seq, self.up, self.pages = f"{self.name}-run{self.runs}", 0, True, {}
        self.history = {0: {}}
        self.stream = None

    def emit(self, kind: str, run: pb.PageRun) -> None:
        self.seq += 1
        self.history[self.seq] = dict(self.pages)
        if self.stream is not None:
            self.stream.append(wire(self.seq, kind, [run], self.server_id))

    def snapshot(self, part_runs: int) -> list[Event]:
        runs = [page_of(k, m) for k, m in sorted(self.pages.items())]
        out = []
        for i in range(0, max(len(runs), 1), part_runs):
            out.append(wire(self.seq, "snapshot", runs[i:i + part_runs], self.server_id,
                            more=i + part_runs < len(runs)))
        return out


part_st = st.sampled_from([2, 1, 512])
node_st = st.sampled_from(NODES)
STORE_MASKS = {"l1": L1, "l2": L2, "l1+l2": L1 | L2}
Change = tuple[int, int, int, int, str]  # namespace, document, first page, pages, what
change_st = st.tuples(st.integers(0, 1), st.integers(0, 3), st.integers(0, 5), st.integers(1, 6),
                      st.sampled_from(["l1", "l2", "l1+l2", "demote", "evict"]))


class IndexVsNodes(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.nodes = {n: Node(n) for n in NODES}
        for nd in self.nodes.values():
            nd.start()
        self.router = Router(CONFIG, router_config(NODES))

    @initialize(warm=st.lists(st.tuples(node_st, change_st), max_size=12), parts=st.tuples(part_st, part_st, part_st))
    def warm_nodes(self, warm: list[tuple[str, Change]], parts: tuple[int, int, int]) -> None:
        """The nodes have served a while when the router starts following them."""
        for n, c in warm:
            self._change(self.nodes[n], c)
        for nd, part_runs in zip(self.nodes.values(), parts, strict=True):
            self._open(nd, part_runs)

    # ------------------------------------------------------------------ feed side (what NodeFeed does)
    def _open(self, nd: Node, part_runs: int) -> None:
        """A new WatchEvents stream: the node's snapshot now, then every later event."""
        nd.stream = collections.deque(nd.snapshot(part_runs))
        nd.sent.clear()

    def _broken(self, nd: Node) -> None:
        """The stream broke (transport, node killed): the feed forgets the node's pages."""
        nd.stream = None
        self.router.disconnected(nd.name, "stream broke")

    def _deliver(self, nd: Node, ev: Event) -> Applied:
        res = self.router.apply_event(nd.name, ev)
        nd.sent.append(ev)
        event(f"delivered {ev.kind}: {res.value}")
        if res is Applied.RESYNC:
            nd.stream = None  # the feed drops this stream and opens a new one
        return res

    # ------------------------------------------------------------------ node side
    @rule(n=node_st, changes=st.lists(change_st, min_size=1, max_size=4))
    def work(self, n: str, changes: list[Change]) -> None:
        """The node serves requests: pages are stored, demoted, evicted (one event each)."""
        nd = self.nodes[n]
        if nd.up:
            for c in changes:
                self._change(nd, c)

    def _change(self, nd: Node, c: Change) -> None:
        """Pages from ``start`` of a document (``pages`` of them at most):

        * ``l1`` / ``l2`` / ``l1+l2``: land on that tier (stored if new to the node, else a tier change);
        * ``demote``: those held on L2 (from ``start`` on) leave L1;
        * ``evict``: those held (from ``start`` on) leave the node (L3 may still have them).
        """
        ns, doc, start, pages, op = c
        keys = KEYS[ns][doc]
        a = min(start, len(keys) - 1)
        b = min(a + pages, len(keys))
        if op in STORE_MASKS:
            mask = STORE_MASKS[op]
            kind = "tier" if any(k in nd.pages for k in keys[a:b]) else "stored"
            for k in keys[a:b]:
                nd.pages[k] = mask
            nd.emit(kind, run_of(ns, doc, a, b, mask, kind))
            return
        need = L2 if op == "demote" else L1 | L2
        while b > a and not all(nd.pages.get(k, 0) & need for k in keys[a:b]):
            b -= 1
        if b == a:
            return
        for k in keys[a:b]:
            if op == "demote":
                nd.pages[k] = L2
            else:
                del nd.pages[k]
        nd.emit("tier" if op == "demote" else "removed", run_of(ns, doc, a, b, L2 if op == "demote" else 0,
                                                                "tier" if op == "demote" else "removed"))

    # ------------------------------------------------------------------ delivery
    @rule(n=node_st, count=st.integers(1, 8), part_runs=part_st)
    def deliver(self, n: str, count: int, part_runs: int) -> None:
        """The next messages of the node's stream arrive (a feed without one reconnects first)."""
        nd = self.nodes[n]
        if nd.up and nd.stream is None:
            self._open(nd, part_runs)
        while count and nd.stream:
            count -= 1
            self._deliver(nd, nd.stream.popleft())

    @rule(n=node_st, fault=st.sampled_from(["duplicate", "lose_one", "swap", "hub_behind", "foreign_run"]),
          data=st.data())
    def fault(self, n: str, fault: str, data: st.DataObject) -> None:
        nd = self.nodes[n]
        if nd.stream is not None:
            getattr(self, "_" + fault)(nd, data)

    def _duplicate(self, nd: Node, data: st.DataObject) -> None:
        """A message of the stream arrives twice: one still to come right after itself, or one delivered
        already (of the last few) again next."""
        q = nd.stream
        assert q is not None
        if nd.sent and (not q or data.draw(st.booleans())):
            ev = data.draw(st.sampled_from(list(nd.sent)))
            q.appendleft(ev)
            event(f"delivered again: {ev.kind}")
        elif q:
            i = data.draw(st.integers(0, len(q) - 1))
            q.insert(i, q[i])
            event(f"duplicated: {q[i].kind}")

    def _lose_one(self, nd: Node, data: st.DataObject) -> None:
        """A delta goes missing while a later-numbered one is still to come, so the gap shows. (Losing the
        newest message with nothing after it cannot be detected by any feed: not a case to test. After a
        swap the newest is not always the last queued.)"""
        q = nd.stream
        assert q is not None
        newest = max((ev.sequence for ev in q if ev.kind != "snapshot"), default=0)
        deltas = [i for i, ev in enumerate(q) if ev.kind != "snapshot" and ev.sequence < newest]
        if deltas:
            del q[data.draw(st.sampled_from(deltas))]

    def _swap(self, nd: Node, data: st.DataObject) -> None:
        """Two adjacent deltas arrive out of order."""
        q = nd.stream
        assert q is not None
        pairs = [i for i in range(len(q) - 1) if q[i].kind != "snapshot" and q[i + 1].kind != "snapshot"]
        if pairs:
            i = data.draw(st.sampled_from(pairs))
            q[i], q[i + 1] = q[i + 1], q[i]

    def _hub_behind(self, nd: Node, data: st.DataObject) -> None:
        """The node's hub found the subscriber's queue full: what it still queued is dropped (what is in
        transit still arrives) and a fresh snapshot follows."""
        q = nd.stream
        assert q is not None
        keep = data.draw(st.integers(0, len(q)))
        while 0 < keep < len(q) and q[keep - 1].snapshot_continues:
            keep += 1  # a snapshot is sent whole before the hub looks at its queue again
        nd.stream = collections.deque(list(q)[:keep] + nd.snapshot(data.draw(part_st)))

    def _foreign_run(self, nd: Node, data: st.DataObject) -> None:
        """A delta of another server run arrives (the node restarted behind the router's back)."""
        ev = wire(nd.seq + 1, "stored", [run_of(0, 2, 0, 1, L1, "stored")], nd.server_id + "-old")
        assert self._deliver(nd, ev) is Applied.RESYNC

    @rule(n=node_st, what=st.sampled_from(["disconnect", "reconnect", "kill", "kill_and_restart", "revive",
                                           "clear", "router_restart"]), part_runs=part_st)
    def lifecycle(self, n: str, what: str, part_runs: int) -> None:
        nd = self.nodes[n]
        if what == "disconnect" and nd.stream is not None:
            self._broken(nd)  # network, or the stats loop gave up on the stream; the node keeps its pages
        elif what == "reconnect" and nd.up and nd.stream is None:
            self._open(nd, part_runs)
        elif what in ("kill", "kill_and_restart") and nd.up:
            self._broken(nd)  # the process died: it comes back empty under a new server id
            nd.up = False
            if what == "kill_and_restart":
                nd.start()
        elif what == "revive" and not nd.up:
            nd.start()
        elif what == "clear" and nd.up:
            self._clear(nd)
        elif what == "router_restart":  # empty index, every live node followed from a fresh snapshot
            self.router = Router(CONFIG, router_config(NODES))
            for other in self.nodes.values():
                other.stream = None
                if other.up:
                    self._open(other, part_runs)

    def _clear(self, nd: Node) -> None:
        """Clear: pages on both tiers first lose L1, then every page leaves, one run per page."""
        for k, m in sorted(nd.pages.items()):
            if m == L1 | L2:
                nd.pages[k] = L2
                nd.emit("tier", page_of(k, L2))
        for k in sorted(nd.pages):
            del nd.pages[k]
            nd.emit("removed", page_of(k, 0))

    # ------------------------------------------------------------------ checks
    @invariant()
    def index_shows_only_states_the_nodes_were_in(self) -> None:
        ix = self.router.index
        mirror: dict[bytes, dict[str, int]] = {}
        for nd in self.nodes.values():
            feed = ix.feed(nd.name)
            if feed.synced:
                assert nd.up and feed.server_id == nd.server_id, nd.name
                assert feed.pages == nd.history[feed.sequence], (nd.name, feed.sequence)
            else:
                assert feed.pages == {}, nd.name
            assert self.router.nodes[nd.name].connected == feed.synced
            if nd.stream is None:
                assert feed.staging is None, nd.name  # no half snapshot kept from a stream that ended
            assert feed.bad_runs == 0, nd.name  # every run the nodes send has the right keys
            for k, m in feed.pages.items():
                mirror.setdefault(k, {})[nd.name] = m
        assert {k: ix.holders(k) for k in mirror} == mirror
        assert len(ix) == len(mirror)
        assert set(ix._feeds) <= set(NODES)

    @rule()
    def settle(self) -> None:
        """Every stream delivered to the end (resyncs reconnect); then the index is the nodes."""
        for _ in range(100):
            busy = False
            for nd in self.nodes.values():
                if nd.up and nd.stream is None:
                    self._open(nd, 2)
                while nd.stream:
                    busy = True
                    self._deliver(nd, nd.stream.popleft())
            if not busy:
                break
        else:
            raise AssertionError("streams did not settle")
        ix = self.router.index
        views = {v.name: v for v in self.router.views()}
        for nd in self.nodes.values():
            feed = ix.feed(nd.name)
            assert feed.synced == nd.up, nd.name
            assert feed.pages == (nd.pages if nd.up else {}), nd.name
            v = views[nd.name]
            if nd.up:
                assert (v.server_id, v.event_sequence) == (nd.server_id, nd.seq)
            assert (v.l1_pages, v.l2_pages) == (sum(1 for m in nd.pages.values() if m & L1 and nd.up),
                                                sum(1 for m in nd.pages.values() if m & L2 and nd.up))
        held = {k for nd in self.nodes.values() if nd.up for k in nd.pages}
        assert len(ix) == len(held)
        for t, (tenant, ns_keys) in enumerate(zip(TENANTS, KEYS, strict=True)):
            for d, keys in enumerate(ns_keys):
                for cut in (len(keys), 3):
                    want = {nd.name: expected_match(nd.pages, keys[:cut]) for nd in self.nodes.values()
                            if nd.up}
                    want = {n: m for n, m in want.items() if m.pages}
                    assert ix.match(keys[:cut]) == want, (t, d, cut)
                    dec = self.router.route(DOCS[d][:cut * PS].astype("<u4").tobytes(), tenant=tenant, peek=True)
                    got = {n: PrefixMatch(s.l1_pages, s.l2_pages) for n, s in dec.scores.items()}
                    assert got == {n: want.get(n, PrefixMatch(0, 0)) for n in NODES}, (t, d, cut)
                    for s in dec.scores.values():
                        assert s.score is not None
                        assert s.score.prefix_score == (s.l1_pages + L2_WEIGHT * s.l2_pages) / cut
                    if want:
                        event("settled: a query with a cached prefix" + (" on L2" if any(
                            m.l2_pages for m in want.values()) else ""))

    def teardown(self) -> None:
        self.settle()


TestIndexVsNodes = IndexVsNodes.TestCase
TestIndexVsNodes.settings = settings(max_examples=200, stateful_step_count=60, deadline=None,
                                     report_multiple_bugs=False)


def test_a_repeated_or_older_snapshot_part_changes_nothing() -> None:
    """The shortest sequences the machine found: the last part of a split snapshot arriving twice used to be
    taken for a whole new snapshot (the node's other pages vanished from the index), and an older snapshot
    of the same run arriving again rolled the index back past events already applied."""
    router = Router(CONFIG, router_config(NODES))
    nd = Node("a")
    nd.start()
    keys = KEYS[0][0]
    for i in range(2):
        nd.pages[keys[i]] = L1
        nd.emit("stored", run_of(0, 0, i, i + 1, L1, "stored"))
    first, last = nd.snapshot(1)
    assert first.snapshot_continues and not last.snapshot_continues
    assert [router.apply_event("a", ev) for ev in (first, last)] == [Applied.IGNORED, Applied.APPLIED]
    assert router.apply_event("a", last) is Applied.IGNORED
    assert router.index.feed("a").pages == {keys[0]: L1, keys[1]: L1}
    nd.pages[keys[2]] = L2
    nd.emit("stored", run_of(0, 0, 2, 3, L2, "stored"))
    router.apply_event("a", wire(nd.seq, "stored", [run_of(0, 0, 2, 3, L2, "stored")], nd.server_id))
    for ev in (first, last):
        assert router.apply_event("a", ev) is Applied.IGNORED
    assert router.index.match(keys)["a"] == PrefixMatch(2, 1)
    assert router.index.feed("a").pages == nd.pages
