"""Property test: random insert / match / lock / pin / evict sequences against a naive page-level model.

The model keeps, per namespace, a dict from each cached page's *whole prefix* (a tuple of tokens) to the
L1 / L2 page index holding it. It knows nothing of nodes or splits. After every step the tree must agree:
a match equals the true longest cached prefix (L1 run, then L2 continuation) with the same page indices;
locked pages are never evicted from L1, pinned pages never from L2; page counts are conserved.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.radix import RadixTree, TreeNode

PAGE = 2
NAMESPACES = [b"ns-a", b"ns-b"]
tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=14)


def tb(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def keys_for(tokens: list[int]) -> list[bytes]:
    return [tb(tokens[: (i + 1) * PAGE]) for i in range(len(tokens) // PAGE)]  # any unique per-prefix value


class TreeVsModel(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "lfu", "priority", "tail_lru", "reuse_lru"]))
    def setup(self, policy: str) -> None:
        self.tree = RadixTree(PAGE, policy)
        # model[ns][prefix] = [device_idx | None, host_idx | None]
        self.model: dict[bytes, dict[tuple[int, ...], list[int | None]]] = {ns: {} for ns in NAMESPACES}
        self.ids = itertools.count()
        self.locks: list[TreeNode] = []
        self.pins: list[TreeNode] = []

    # -- helpers -------------------------------------------------------------------------------
    def _full(self, tokens: list[int]) -> list[int]:
        return tokens[: len(tokens) - len(tokens) % PAGE]

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

    def _tree_state(self) -> dict[bytes, dict[tuple[int, ...], list[int | None]]]:
        out: dict[bytes, dict[tuple[int, ...], list[int | None]]] = {ns: {} for ns in NAMESPACES}
        for ns, root in self.tree.roots.items():
            stack: list[tuple[TreeNode, tuple[int, ...]]] = [(c, ()) for c in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                toks = tuple(int(x) for x in np.frombuffer(node.key, dtype="<u4"))
                for j in range(node.n_pages):
                    p = prefix + toks[: (j + 1) * PAGE]
                    out[ns][p] = [
                        None if node.device is None else int(node.device[j]),
                        None if node.host is None else int(node.host[j]),
                    ]
                stack.extend((c, prefix + toks) for c in node.children.values())
        return out

    def _protected(self) -> tuple[set[tuple[bytes, tuple[int, ...]]], set[tuple[bytes, tuple[int, ...]]]]:
        """Pages under a lock (must stay on L1) and under a pin (must stay on L2)."""
        locked, pinned = set(), set()
        for ns, root in self.tree.roots.items():
            stack: list[tuple[TreeNode, tuple[int, ...]]] = [(c, ()) for c in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                toks = tuple(int(x) for x in np.frombuffer(node.key, dtype="<u4"))
                for j in range(node.n_pages):
                    p = (ns, prefix + toks[: (j + 1) * PAGE])
                    if node.lock_ref:
                        locked.add(p)
                    if node.host_pin and node.host is not None:
                        pinned.add(p)
                stack.extend((c, prefix + toks) for c in node.children.values())
        return locked, pinned

    # -- rules ---------------------------------------------------------------------------------
    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_st)
    def match(self, ns: bytes, tokens: list[int]) -> None:
        m = self.tree.match(ns, tb(tokens))
        dev, host = self._model_match(ns, tokens)
        assert m.device_indices.tolist() == dev
        assert m.host_indices.tolist() == host

    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_st)
    def insert_device(self, ns: bytes, tokens: list[int]) -> None:
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

    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_st)
    def insert_host_after_match(self, ns: bytes, tokens: list[int]) -> None:
        """What a finished L3 prefetch does: add L2 pages after the currently matched prefix."""
        tokens = self._full(tokens)
        dev, host = self._model_match(ns, tokens)
        start = len(dev) + len(host)
        n = len(tokens) // PAGE
        if start == 0 and n == 0:
            return
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

    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_st)
    def lock_l1_prefix(self, ns: bytes, tokens: list[int]) -> None:
        m = self.tree.match(ns, tb(tokens))
        if m.l1_node is not None:
            self.tree.lock(m.l1_node)
            self.locks.append(m.l1_node)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.tree.unlock(node)

    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_st)
    def pin_l2_run(self, ns: bytes, tokens: list[int]) -> None:
        m = self.tree.match(ns, tb(tokens))
        if m.host_nodes:
            self.tree.pin_host(m.host_nodes[-1])
            self.pins.append(m.host_nodes[-1])

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        node = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.tree.unpin_host(node)

    @rule(n=st.integers(1, 8), backup=st.booleans())
    def evict_device(self, n: int, backup: bool) -> None:
        before = self._tree_state()
        locked, _ = self._protected()
        backed: dict[int, int] = {}

        def do_backup(node: TreeNode) -> bool:
            if not backup:
                return False
            host = np.array([next(self.ids) for _ in range(node.n_pages)], dtype=np.int64)
            self.tree.set_host(node, host)
            backed.update(zip(node.device.tolist(), host.tolist(), strict=True))  # type: ignore[union-attr]
            return True

        l1_before = self.tree.device_pages
        freed = self.tree.evict_device(n, do_backup)
        count = sum(len(f) for f in freed)
        assert self.tree.device_pages == l1_before - count
        if count < n:  # only stops early when nothing evictable is left
            assert not any(self.tree._l1_evictable(x) for x in self.tree.nodes() if x.host is not None or
                           not x.children)
        after = self._tree_state()
        freed_set = set(np.concatenate(freed).tolist()) if freed else set()
        for ns in NAMESPACES:
            for p, (d, h) in before[ns].items():
                if (ns, p) in locked:
                    assert after[ns][p][0] == d, "a locked page left L1"
                if p in after[ns]:
                    d2, h2 = after[ns][p]
                    assert d2 is None or d2 == d
                    if d2 is None and d is not None:
                        assert d in freed_set
                    assert h2 == (h if h is not None else backed.get(d))  # type: ignore[arg-type]
                else:
                    assert d is None or d in freed_set
        self.model = after

    @rule(n=st.integers(1, 8))
    def evict_host(self, n: int) -> None:
        before = self._tree_state()
        _, pinned = self._protected()
        l2_before = self.tree.host_pages
        freed = self.tree.evict_host(n)
        count = sum(len(f) for f in freed)
        assert self.tree.host_pages == l2_before - count
        after = self._tree_state()
        for ns in NAMESPACES:
            for p, (d, h) in before[ns].items():
                if (ns, p) in pinned or d is not None:
                    assert after[ns].get(p) == [d, h], "a pinned or L1 page was evicted from L2"
        self.model = after

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "tree"):
            self.tree.check_invariants()
            assert self._tree_state() == self.model


TestTreeVsModel = TreeVsModel.TestCase
TestTreeVsModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
