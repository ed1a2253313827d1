"""Property test: random insert / match / lock / pin / evict sequences against a naive page-level model.

The model keeps, per namespace, a dict from each cached page's *whole prefix* (a tuple of tokens) to the
L1 / L2 page index holding it, plus the path (end prefix) of every lock and pin taken. It knows nothing of
nodes or splits. After every step the tree must agree: a match equals the true longest cached prefix (L1
run, then L2 continuation) with the same page indices; every page's lock/pin count equals the number of
locks/pins whose path covers it; locked pages are never evicted from L1, pinned pages never from L2;
evictions free exactly the indices that leave the tree and stop as soon as enough is freed (or nothing
evictable is left); page counts are conserved. The model is updated from the freed indices, never copied
from the tree.

Rules draw their tokens mostly from prefixes of sequences inserted earlier (at page granularity, sometimes
with extra tokens), so matches, locks and pins usually land on cached pages; ``hypothesis.event`` reports
how often (``--hypothesis-show-statistics``).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.radix import RadixTree, TreeNode

PAGE = 2
NAMESPACES = [b"ns-a", b"ns-b"]
token_st = st.integers(0, 3)
tokens_st = st.lists(token_st, min_size=0, max_size=14)
Prefix = tuple[int, ...]
Page = tuple[bytes, Prefix]  # (namespace, whole prefix ending with the page)
Model = dict[bytes, dict[Prefix, list[int | None]]]  # model[ns][prefix] = [device_idx | None, host_idx | None]
# per-namespace caps (cache.tenant_shares): pages of the tier beyond which a namespace is evicted first
caps_st = st.none() | st.dictionaries(st.sampled_from(NAMESPACES), st.integers(0, 8), min_size=1)


def tb(tokens: list[int] | Prefix) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def keys_for(tokens: list[int]) -> list[bytes]:
    return [tb(tokens[: (i + 1) * PAGE]) for i in range(len(tokens) // PAGE)]  # any unique per-prefix value


def pages_of(ns: bytes, end: Prefix) -> list[Page]:
    """The pages on the path from the root to ``end`` (a lock or pin covers all of them)."""
    return [(ns, end[: (i + 1) * PAGE]) for i in range(len(end) // PAGE)]


class TreeVsModel(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["lru", "lfu", "priority", "hedge_lru", "reuse_lru", "arc"]),
        seed=st.lists(
            st.tuples(
                st.sampled_from(NAMESPACES),
                st.lists(token_st, min_size=PAGE, max_size=14),
                st.sampled_from(["l1", "l1+lock", "l2", "l2+pin"]),
            ),
            min_size=1,
            max_size=4,
        ),
    )
    def setup(self, policy: str, seed: list[tuple[bytes, list[int], str]]) -> None:
        """A fresh tree with a few sequences already inserted on L1 or L2, some of them locked / pinned
        (so that matches hit and evictions meet locks and pins even in runs that leave out the insert,
        lock or pin rules; evictions still empty the tree often enough)."""
        self.tree = RadixTree(PAGE, policy)
        self.model: Model = {ns: {} for ns in NAMESPACES}
        self.ids = itertools.count()
        self.seqs: list[tuple[bytes, Prefix]] = []  # every distinct non-empty sequence inserted so far
        self.seen: set[tuple[bytes, Prefix]] = set()
        self.locks: list[tuple[TreeNode, bytes, Prefix]] = []  # node, namespace, path of the node at lock time
        self.pins: list[tuple[TreeNode, bytes, Prefix]] = []
        for ns, tokens, how in seed:
            node = (self._insert_host if how.startswith("l2") else self._insert_device)(ns, tokens)
            if node is not None and how == "l1+lock":
                self._lock(node)
            if node is not None and node.host is not None and how == "l2+pin":
                self._pin(node)

    # -- helpers -------------------------------------------------------------------------------
    def _full(self, tokens: list[int]) -> list[int]:
        return tokens[: len(tokens) - len(tokens) % PAGE]

    def _draw_tokens(self, data: st.DataObject, what: str) -> tuple[bytes, list[int]]:
        """Mostly a prefix of a sequence inserted earlier and still (partly) cached: whole pages, sometimes
        plus a few more tokens (which may diverge, or end mid-page); sometimes random tokens."""
        if self.seqs and data.draw(st.integers(0, 4), label=f"{what}: 4=random") < 4:
            live = [(ns, q) for ns, q in self.seqs if q[:PAGE] in self.model[ns]]  # still (partly) cached
            ns, seq = data.draw(st.sampled_from(live or self.seqs), label=f"{what}: inserted seq")
            k = data.draw(st.integers(1, len(seq) // PAGE), label=f"{what}: pages of it")
            tail = data.draw(st.one_of(st.just([]), st.lists(token_st, min_size=1, max_size=5)), label="tail")
            event(f"{what}: tokens from an inserted prefix" + (" + tail" if tail else ""))
            return ns, list(seq[: k * PAGE]) + tail
        event(f"{what}: random tokens")
        toks = st.lists(token_st, min_size=1, max_size=14) if what.startswith("insert") else tokens_st
        return data.draw(st.sampled_from(NAMESPACES), label=f"{what}: ns"), data.draw(toks, label=what)

    def _remember(self, ns: bytes, tokens: list[int]) -> None:
        key = (ns, tuple(tokens))
        if tokens and key not in self.seen:
            self.seen.add(key)
            self.seqs.append(key)

    def _path(self, node: TreeNode) -> tuple[bytes, Prefix]:
        """Namespace and whole token prefix ending with ``node`` (which must hang from a root)."""
        parts: list[bytes] = []
        root = node
        while root.parent is not None:
            parts.append(root.key)
            root = root.parent
        ns = next((k for k, r in self.tree.roots.items() if r is root), None)
        assert ns is not None, "node is no longer in the tree"
        toks = np.frombuffer(b"".join(reversed(parts)), dtype="<u4")
        return ns, tuple(int(x) for x in toks)

    def _model_match(self, ns: bytes, tokens: list[int]) -> tuple[list[int], list[int]]:
        dev: list[int] = []
        host: list[int] = []
        m = self.model[ns]
        for i in range(len(tokens) // PAGE):
            entry = m.get(tuple(tokens[: (i + 1) * PAGE]))
            if entry is None:
                break
            if entry[0] is not None and not host:
                dev.append(entry[0])
            elif entry[1] is not None:
                host.append(entry[1])
            else:
                break
        return dev, host

    def _walk_tree(self) -> list[tuple[Page, TreeNode, int]]:
        """Every page the tree holds: (page, its node, its index within the node)."""
        out: list[tuple[Page, TreeNode, int]] = []
        for ns, root in self.tree.roots.items():
            stack: list[tuple[TreeNode, Prefix]] = [(c, ()) for c in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                toks = tuple(int(x) for x in np.frombuffer(node.key, dtype="<u4"))
                for j in range(node.n_pages):
                    out.append(((ns, prefix + toks[: (j + 1) * PAGE]), node, j))
                stack.extend((c, prefix + toks) for c in node.children.values())
        return out

    def _tree_state(self, walk: list[tuple[Page, TreeNode, int]] | None = None) -> Model:
        out: Model = {ns: {} for ns in NAMESPACES}
        for (ns, p), node, j in self._walk_tree() if walk is None else walk:
            out[ns][p] = [
                None if node.device is None else int(node.device[j]),
                None if node.host is None else int(node.host[j]),
            ]
        return out

    def _covered(self, held: list[tuple[TreeNode, bytes, Prefix]]) -> dict[Page, int]:
        """How many locks (or pins) cover each page, from the model's record of their paths."""
        count: dict[Page, int] = {}
        for _, ns, end in held:
            for page in pages_of(ns, end):
                count[page] = count.get(page, 0) + 1
        return count

    def _indices(self, tier: int) -> dict[int, Page]:
        return {i: (ns, p) for ns, m in self.model.items() for p, e in m.items() if (i := e[tier]) is not None}

    def _has_child(self, ns: bytes, p: Prefix, tier: int | None = None) -> bool:
        """Whether the model holds a page right after ``p`` (on ``tier`` when given)."""
        m = self.model[ns]
        return any(
            len(q) == len(p) + PAGE and q[: len(p)] == p and (tier is None or m[q][tier] is not None) for q in m
        )

    def has_pages(self, counter: str) -> bool:
        return hasattr(self, "tree") and getattr(self.tree, counter) > 0

    def _tree_nodes(self, tier: str) -> list[TreeNode]:
        return [n for n in self.tree.nodes() if getattr(n, tier) is not None]

    # -- rules ---------------------------------------------------------------------------------
    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        ns, tokens = self._draw_tokens(data, "match")
        m = self.tree.match(ns, tb(tokens))
        dev, host = self._model_match(ns, tokens)
        event(f"match: L1 {'hit' if dev else 'miss'}, L2 {'hit' if host else 'miss'}")
        assert m.device_indices.tolist() == dev
        assert m.host_indices.tolist() == host
        assert (m.l1_node is None) == (not dev)
        if dev:
            assert m.l1_node is not None and self._path(m.l1_node) == (ns, tuple(tokens[: len(dev) * PAGE]))
        if host:
            end = tuple(tokens[: (len(dev) + len(host)) * PAGE])
            assert self._path(m.host_nodes[-1]) == (ns, end) and m.node is m.host_nodes[-1]

    @rule(data=st.data())
    def insert_device(self, data: st.DataObject) -> None:
        self._insert_device(*self._draw_tokens(data, "insert_device"))

    @rule(data=st.data())
    def insert_host_after_match(self, data: st.DataObject) -> None:
        """What a finished L3 prefetch does: add L2 pages after the currently matched prefix."""
        self._insert_host(*self._draw_tokens(data, "insert_host"))

    def _insert_device(self, ns: bytes, tokens: list[int]) -> TreeNode | None:
        tokens = self._full(tokens)
        n = len(tokens) // PAGE
        idx = np.array([next(self.ids) for _ in range(n)], dtype=np.int64)
        res = self.tree.insert(ns, tb(tokens), keys_for(tokens), device=idx)
        assert res is not None
        m = self.model[ns]
        for i in range(n):
            p = tuple(tokens[: (i + 1) * PAGE])
            entry = m.setdefault(p, [None, None])
            assert bool(res.reused[i]) == (entry[0] is not None)
            if entry[0] is None:
                entry[0] = int(idx[i])
        assert res.new_pages == int((~res.reused).sum())
        if n:
            assert self._path(res.node) == (ns, tuple(tokens))
            event("insert_device: " + ("all pages new" if not res.reused.any() else
                                       "all pages reused" if res.reused.all() else "some pages reused"))
        self._remember(ns, tokens)
        return res.node if n else None

    def _insert_host(self, ns: bytes, tokens: list[int]) -> TreeNode | None:
        tokens = self._full(tokens)
        dev, host = self._model_match(ns, tokens)
        start = len(dev) + len(host)
        n = len(tokens) // PAGE
        if start == 0 and n == 0:
            return None
        event("insert_host: after a cached prefix" if start else "insert_host: from the root")
        idx = np.array([next(self.ids) for _ in range(n - start)], dtype=np.int64)
        res = self.tree.insert(ns, tb(tokens), keys_for(tokens), host=idx, start_page=start)
        assert res is not None
        m = self.model[ns]
        for i in range(start, n):
            p = tuple(tokens[: (i + 1) * PAGE])
            entry = m.setdefault(p, [None, None])
            assert bool(res.reused[i]) == (entry[1] is not None)
            if entry[1] is None:
                entry[1] = int(idx[i - start])
        assert res.new_pages == int((~res.reused).sum())
        assert self._path(res.node) == (ns, tuple(tokens))
        self._remember(ns, tokens)
        return res.node

    @precondition(lambda self: self.has_pages("device_pages"))
    @rule(data=st.data())
    def lock_l1(self, data: st.DataObject) -> None:
        """Lock the L1 run of a match (as a request does), or any L1 node."""
        node = None
        if data.draw(st.booleans(), label="lock via match"):
            ns, tokens = self._draw_tokens(data, "lock")
            node = self.tree.match(ns, tb(tokens)).l1_node
        event("lock: node from a match" if node is not None else "lock: any L1 node")
        if node is None:
            node = data.draw(st.sampled_from(self._tree_nodes("device")), label="L1 node")
        self._lock(node)

    def _lock(self, node: TreeNode) -> None:
        ns, end = self._path(node)
        self.tree.lock(node)
        self.locks.append((node, ns, end))

    @precondition(lambda self: bool(getattr(self, "locks", None)))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node, ns, end = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        assert self._path(node) == (ns, end), "a locked node moved or left the tree"
        self.tree.unlock(node)

    @precondition(lambda self: self.has_pages("host_pages"))
    @rule(data=st.data())
    def pin_l2(self, data: st.DataObject) -> None:
        """Pin the L2 continuation of a match (as a load-back does), or any L2 node."""
        node = None
        if data.draw(st.booleans(), label="pin via match"):
            ns, tokens = self._draw_tokens(data, "pin")
            hn = self.tree.match(ns, tb(tokens)).host_nodes
            node = hn[-1] if hn else None
        event("pin: node from a match" if node is not None else "pin: any L2 node")
        if node is None:
            node = data.draw(st.sampled_from(self._tree_nodes("host")), label="L2 node")
        self._pin(node)

    def _pin(self, node: TreeNode) -> None:
        ns, end = self._path(node)
        self.tree.pin_host(node)
        self.pins.append((node, ns, end))

    @precondition(lambda self: bool(getattr(self, "pins", None)))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        node, ns, end = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        assert self._path(node) == (ns, end), "a pinned node moved or left the tree"
        self.tree.unpin_host(node)

    def _check_caps_first(self, caps: dict[bytes, int] | None, held_before: dict[bytes, int],
                          lost: dict[bytes, int], evictable: Any, tier: int) -> None:
        """A namespace at or under its cap (or without one) lost pages only once every namespace over its
        cap was brought down to it or had nothing evictable left."""
        if not caps:
            return
        over = {ns for ns, cap in caps.items() if held_before.get(ns, 0) > cap}
        if not over or not any(lost.get(ns, 0) for ns in NAMESPACES if ns not in over):
            return
        event(f"caps: tier {tier} evicted past an over-cap namespace")
        for ns in over:
            held = sum(1 for e in self.model[ns].values() if e[tier] is not None)
            assert held <= caps[ns] or not any(evictable(ns, p, e) for p, e in self.model[ns].items()), \
                f"{ns!r} still over its cap {caps[ns]} ({held}) with pages to evict, yet others lost pages"

    @precondition(lambda self: self.has_pages("device_pages"))
    @rule(n=st.integers(1, 8), backup=st.booleans(), caps=caps_st)
    def evict_device(self, n: int, backup: bool, caps: dict[bytes, int] | None) -> None:
        locked = self._covered(self.locks)
        dev_before = self._indices(0)
        host_before = set(self._indices(1))
        backed: dict[int, int] = {}

        def do_backup(node: TreeNode) -> bool:
            assert self.tree._l1_evictable(node) and node.host is None
            if not backup:
                return False
            host = np.array([next(self.ids) for _ in range(node.n_pages)], dtype=np.int64)
            self.tree.set_host(node, host)
            backed.update(zip(node.device.tolist(), host.tolist(), strict=True))  # type: ignore[union-attr]
            return True

        l1_before = self.tree.device_pages
        freed = self.tree.evict_device(n, do_backup, caps)
        flat = np.concatenate(freed).tolist() if freed else []
        freed_set = set(flat)
        assert len(flat) == len(freed_set), "an L1 page freed twice"
        count = len(flat)
        assert self.tree.device_pages == l1_before - count
        if freed:
            assert count - len(freed[-1]) < n, "evicted more nodes than needed"

        after = self._tree_state()
        dev_after = {e[0] for m in after.values() for e in m.values() if e[0] is not None}
        host_after = {e[1] for m in after.values() for e in m.values() if e[1] is not None}
        assert freed_set == set(dev_before) - dev_after, "freed L1 indices != L1 indices that left the tree"
        assert dev_after <= set(dev_before)
        assert host_after == host_before | set(backed.values()), "L1 eviction changed L2 beyond the backups"
        assert set(backed) <= freed_set, "a backed-up node was not evicted"

        # the model's own update: each freed page leaves L1, keeping (or gaining via backup) its L2 copy
        for d in flat:
            ns, p = dev_before[d]
            assert (ns, p) not in locked, "a locked page left L1"
            entry = self.model[ns][p]
            entry[0] = None
            if entry[1] is None:
                entry[1] = backed.get(d)
            if entry[1] is None:
                del self.model[ns][p]
        for ns, p in locked:
            assert self.model[ns].get(p, [None])[0] is not None, "a locked page is off L1"
        held_before: dict[bytes, int] = {}
        for ns, _ in dev_before.values():
            held_before[ns] = held_before.get(ns, 0) + 1
        lost: dict[bytes, int] = {}
        for d in flat:
            lost[dev_before[d][0]] = lost.get(dev_before[d][0], 0) + 1
        self._check_caps_first(caps, held_before, lost, lambda ns, p, e: (
            e[0] is not None and (ns, p) not in locked and not self._has_child(ns, p, 0)
            and (e[1] is not None or backup or not self._has_child(ns, p))), 0)

        if count < n:  # only stops early when nothing evictable is left
            for ns, m in self.model.items():
                for p, (d, h) in m.items():
                    if d is None or (ns, p) in locked or self._has_child(ns, p, 0):
                        continue
                    # an unlocked L1 page ending its L1 run: evictable unless it has L2-only children
                    # and could not be backed up
                    assert not (h is not None or backup or not self._has_child(ns, p)), \
                        f"stopped early with an evictable L1 page {ns!r} {p}"

        n_locked = len(locked)
        event("evict_device: " + ("with locked L1 pages" if n_locked else "no lock held"))
        if n_locked and count < n:
            event("evict_device: stopped short with locked L1 pages")
        if count:
            event("evict_device: freed pages" + (" with locked L1 pages" if n_locked else ""))
        if backed:
            event("evict_device: backed up to L2")

    @precondition(lambda self: self.has_pages("host_pages"))
    @rule(n=st.integers(1, 8), caps=caps_st)
    def evict_host(self, n: int, caps: dict[bytes, int] | None) -> None:
        pinned = self._covered(self.pins)
        dev_before = set(self._indices(0))
        host_before = self._indices(1)
        n_pinned = len(pinned.keys() & set(host_before.values()))  # pinned pages that are on L2
        l2_before = self.tree.host_pages
        freed = self.tree.evict_host(n, caps)
        flat = np.concatenate(freed).tolist() if freed else []
        freed_set = set(flat)
        assert len(flat) == len(freed_set), "an L2 page freed twice"
        count = len(flat)
        assert self.tree.host_pages == l2_before - count
        if freed:
            assert count - len(freed[-1]) < n, "evicted more nodes than needed"

        after = self._tree_state()
        dev_after = {e[0] for m in after.values() for e in m.values() if e[0] is not None}
        host_after = {e[1] for m in after.values() for e in m.values() if e[1] is not None}
        assert freed_set == set(host_before) - host_after, "freed L2 indices != L2 indices that left the tree"
        assert host_after <= set(host_before)
        assert dev_after == dev_before, "L2 eviction changed L1"

        # the model's own update: each freed page (L2-only, unpinned) leaves the tree
        for h in flat:
            ns, p = host_before[h]
            assert (ns, p) not in pinned, "a pinned page was evicted from L2"
            assert self.model[ns][p][0] is None, "an L1 page was evicted from L2"
            del self.model[ns][p]
        held_before: dict[bytes, int] = {}
        for ns, _ in host_before.values():
            held_before[ns] = held_before.get(ns, 0) + 1
        lost: dict[bytes, int] = {}
        for h in flat:
            lost[host_before[h][0]] = lost.get(host_before[h][0], 0) + 1
        self._check_caps_first(caps, held_before, lost, lambda ns, p, e: (
            e[0] is None and e[1] is not None and (ns, p) not in pinned and not self._has_child(ns, p)), 1)

        if count < n:  # only stops early when nothing evictable is left
            for ns, m in self.model.items():
                for p, (d, h) in m.items():
                    assert not (d is None and h is not None and (ns, p) not in pinned
                                and not self._has_child(ns, p)), f"stopped early with an evictable L2 page {p}"

        event("evict_host: " + ("with pinned L2 pages" if n_pinned else "no pinned L2 page"))
        if n_pinned and count < n:
            event("evict_host: stopped short with pinned L2 pages")
        if count:
            event("evict_host: freed pages" + (" with pinned L2 pages" if n_pinned else ""))

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.tree.check_invariants()
        walk = self._walk_tree()
        assert self._tree_state(walk) == self.model
        for m in self.model.values():
            for p, (d, _) in m.items():
                parent = m.get(p[:-PAGE]) if len(p) > PAGE else None
                assert len(p) == PAGE or parent is not None, "a page without its parent page"
                assert d is None or len(p) == PAGE or parent[0] is not None, "L1 not prefix-closed"  # type: ignore[index]
        locks, pins = self._covered(self.locks), self._covered(self.pins)
        for page, node, _ in walk:
            assert node.lock_ref == locks.get(page, 0), f"lock count of {page}"
            assert node.host_pin == pins.get(page, 0), f"pin count of {page}"


TestTreeVsModel = TreeVsModel.TestCase
TestTreeVsModel.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
