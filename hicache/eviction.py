"""Eviction order: a registry of policies.

A policy maps a tree node to a sort key; the node with the *smallest* key is evicted first. Policies
see only what the node records (``last_access``, ``hit_count``, ``priority``, ``n_pages``), so they are
online: they know nothing of future requests.

A policy is either a key function (``@register_policy`` on a function) or a stateful
:class:`EvictionPolicy` subclass (``@register_policy`` on the class): the tree builds one instance of it,
binds it to itself and tells it, as they happen, of matches, inserts, splits and removals, so it can
keep its own per-node state (``TreeNode.meta``) and per-tree state (e.g. what it evicted lately).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.radix import RadixTree, TreeNode

EvictionKey = Callable[["TreeNode"], Any]


class EvictionPolicy:
    """A policy with state: one instance per tree (``make_policy``), told of what happens to the tree.

    ``key`` orders eviction (smallest first), as a key function does. The hooks run under the tree's
    lock on every match and insert, so they must be O(1)-ish; they must not change the tree.
    """

    observes = True  # the tree calls the hooks below

    def bind(self, tree: RadixTree) -> None:
        """Called once, by the tree the policy serves."""

    def key(self, node: TreeNode) -> Any:
        raise NotImplementedError

    def on_match(self, node: TreeNode, now: int) -> None:
        """A lookup (``match`` with touch) used ``node``: a hit of its pages."""

    def on_insert(self, node: TreeNode, now: int, created: bool) -> None:
        """An insert went through ``node``; ``created``: it is a new leaf (already attached)."""

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        """``lower`` was cut after its first pages, which now form the new node ``upper`` (its parent)."""

    def on_remove(self, node: TreeNode) -> None:
        """``node`` left the tree (evicted from its last tier); it is detached right after this call."""


class _KeyPolicy(EvictionPolicy):
    """A key function as an :class:`EvictionPolicy` that observes nothing."""

    observes = False

    def __init__(self, fn: EvictionKey) -> None:
        self.fn = fn
        self.key = fn  # type: ignore[method-assign,assignment]  # the bare function: no call in between


_POLICIES: dict[str, EvictionKey] = {}
_STATEFUL: dict[str, type[EvictionPolicy]] = {}


def register_policy(name: str) -> Callable[[Any], Any]:
    """Decorator: make a key function or an :class:`EvictionPolicy` subclass selectable as
    ``eviction_policy: <name>``."""

    def deco(obj: Any) -> Any:
        if isinstance(obj, type) and issubclass(obj, EvictionPolicy):
            _STATEFUL[name] = obj
            _POLICIES.pop(name, None)
        else:
            _POLICIES[name] = obj
            _STATEFUL.pop(name, None)
        return obj

    return deco


def get_policy(name: str) -> EvictionKey:
    """The key function of policy ``name`` (of a fresh instance, for a stateful policy)."""
    return make_policy(name).key


def make_policy(name: str) -> EvictionPolicy:
    """A policy instance for one tree."""
    cls = _STATEFUL.get(name)
    if cls is not None:
        return cls()
    fn = _POLICIES.get(name)
    if fn is None:
        raise ValueError(f"eviction_policy: unknown policy {name!r}; known: {policy_names()}")
    return _KeyPolicy(fn)


def policy_names() -> list[str]:
    return sorted(set(_POLICIES) | set(_STATEFUL))


@register_policy("lru")
def lru(node: TreeNode) -> Any:
    """Least recently used first."""
    return node.last_access


@register_policy("lfu")
def lfu(node: TreeNode) -> Any:
    """Least frequently used first; ties broken by recency."""
    return (node.hit_count, node.last_access)


@register_policy("priority")
def priority(node: TreeNode) -> Any:
    """Lowest caller-set ``priority`` first (e.g. per-tenant or per-request class), then LRU."""
    return (node.priority, node.last_access)


ONE_OFF_SAMPLE = 16  # siblings looked at to judge whether a parent's children tend to be one-offs
ONE_OFF_SHARE = 0.5  # share of those that must be one-off leaves


def is_one_off_tail(node: TreeNode) -> bool:
    """A leaf not used since it was inserted, whose siblings are mostly such leaves as well.

    That is the shape of the unique end of a request under shared content -- a RAG question under its
    documents, the text to classify under a few-shot block -- which is rarely asked for again. A fresh
    conversation turn is a leaf too, but its siblings are older turns that were extended (they have
    children), so it is not a one-off tail. Looks at up to ``ONE_OFF_SAMPLE`` siblings (oldest first).
    """
    parent = node.parent
    if parent is None or node.children or node.hit_count > 1:
        return False
    sample = [x for x in itertools.islice(parent.children.values(), ONE_OFF_SAMPLE + 1) if x is not node]
    sample = sample[:ONE_OFF_SAMPLE]
    if len(sample) < 2:
        return False
    one_off = sum(1 for x in sample if not x.children and x.hit_count <= 1)
    return one_off >= ONE_OFF_SHARE * len(sample)


@register_policy("tail_lru")
def tail_lru(node: TreeNode) -> Any:
    """LRU, except that one-off tails (:func:`is_one_off_tail`) go first (LRU among them).

    On the bench's RAG and few-shot workloads it keeps the shared prefixes that plain LRU loses to a
    stream of fresh question tails; on multi-turn chat it orders exactly as LRU does.
    """
    return (not is_one_off_tail(node), node.last_access)


class _Birth:
    """One leaf's insertion: its origin class, whether a later request reused it, and whether (part of) it
    left the tree unused first."""

    __slots__ = ("origin", "reused", "wasted")

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.reused = False
        self.wasted = False


class _Seen:
    """``TreeNode.meta`` under :class:`ReuseLRU`: the node's birth (shared by the halves of a split) and
    whether a request has hit this node's own pages."""

    __slots__ = ("birth", "hit")

    def __init__(self, birth: _Birth, hit: bool) -> None:
        self.birth = birth
        self.hit = hit


@register_policy("reuse_lru")
class ReuseLRU(EvictionPolicy):
    """LRU, except that leaves which are probably never used again go first (LRU among them); what is
    "probably" is learned online, per origin of a leaf, from what happened to earlier leaves.

    Contract. A new leaf is classed by where it hangs when inserted: ``fresh`` (under the root: new
    content from its first page), ``extend`` (under a node that had no other child: a conversation's
    next turn) or ``branch`` (beside siblings: a new question under shared documents, a new tail under
    a shared prompt). A leaf is *settled* when a later request hits it (reused) or when it leaves the
    tree unhit (wasted). For each origin the policy keeps the share of settled leaves that were reused,
    decayed (``REUSE_DECAY``: the last few hundred outcomes count; prior: one reuse in two, so an origin
    starts out neutral and leaves still waiting for their outcome do not count). A node is *probation*
    when no request has hit it yet and its origin's reuse share is below ``ONE_OFF_SHARE``; probation
    nodes are evicted before all others, LRU within each group. Nodes of origins that are mostly reused
    (a conversation's newest turn), and every node a request hit, are kept by plain recency.

    A reuse that comes after the leaf was already evicted still counts (its wasted outcome becomes a
    reuse), and protects the re-inserted content: the policy remembers the page keys of the last
    ``GHOST_FACTOR`` x (most pages the tree ever held) pages it removed (a ghost list, as in ARC / 2Q);
    a new leaf holding one of them counts as a reuse of that earlier birth and starts out hit. Without
    the ghost, an origin whose leaves are evicted before their reuse would look never-reused and stay
    in probation for good.

    Why: on traces where new content is mostly requested once (Mooncake: about a third of new
    documents come back, tails under a shared prefix almost never) plain LRU spends most of its
    capacity on content never asked for again; on RAG / few-shot it evicts the fresh question tails
    first, as ``tail_lru`` does, without scanning siblings; on multi-turn chat, where a new leaf is
    nearly always continued, it orders as LRU does. Online: it uses only past requests. Measured
    (``benchmarks/hit_rate.py``): Mooncake at 10% / 30% of the working set 54% / 77% of the offline
    optimum (LRU 49% / 75%, ``tail_lru`` 50% / 75%); the synthetic workloads as ``tail_lru``.

    Cost: O(1) per key and per touched node (three origins); inserting a leaf looks its page keys up
    in the ghost list (O(pages), like hashing them); the ghost holds at most ``GHOST_FACTOR`` x peak
    pages keys (32 bytes each).
    """

    ONE_OFF_SHARE = 0.5  # below this reuse share a never-hit leaf is more likely wasted than used
    REUSE_DECAY = 1 / 256  # weight lost per birth: the share follows the last few hundred leaves
    GHOST_FACTOR = 2.0  # ghost list length, in multiples of the most pages the tree has held

    def bind(self, tree: RadixTree) -> None:
        self.tree = tree
        self.reuses: dict[str, float] = {"fresh": 0.0, "extend": 0.0, "branch": 0.0}
        self.wasted: dict[str, float] = {"fresh": 0.0, "extend": 0.0, "branch": 0.0}
        self.ghost: OrderedDict[bytes, _Birth] = OrderedDict()
        self.peak_pages = 1

    def reuse_share(self, origin: str) -> float:
        """Decayed share of ``origin``'s settled leaves that a later request reused (prior: 1 in 2)."""
        return (self.reuses[origin] + 1.0) / (self.reuses[origin] + self.wasted[origin] + 2.0)

    def _settle(self, origin: str, reused: bool) -> None:
        keep = 1.0 - self.REUSE_DECAY
        for o in self.reuses:
            self.reuses[o] *= keep
            self.wasted[o] *= keep
        if reused:
            self.reuses[origin] += 1.0
        else:
            self.wasted[origin] += 1.0

    def probation(self, node: TreeNode) -> bool:
        m = node.meta
        return m is not None and not m.hit and self.reuse_share(m.birth.origin) < self.ONE_OFF_SHARE

    def key(self, node: TreeNode) -> Any:
        return (not self.probation(node), node.last_access)

    def _reused(self, birth: _Birth) -> None:
        if not birth.reused:
            birth.reused = True
            if birth.wasted:  # settled as wasted when it left the tree; the ghost list saw it again
                self.wasted[birth.origin] = max(0.0, self.wasted[birth.origin] - 1.0)
            self._settle(birth.origin, True)

    def on_match(self, node: TreeNode, now: int) -> None:
        m = node.meta
        if m is not None:
            m.hit = True
            self._reused(m.birth)

    def on_insert(self, node: TreeNode, now: int, created: bool) -> None:
        if not created:
            return
        parent = node.parent
        assert parent is not None
        origin = "fresh" if parent.parent is None else "extend" if len(parent.children) == 1 else "branch"
        hit = False
        for pk in node.page_keys:
            earlier = self.ghost.pop(pk, None)
            if earlier is not None:
                self._reused(earlier)
                hit = True
                break
        node.meta = _Seen(_Birth(origin), hit)
        self.peak_pages = _peak_pages(self.tree, self.peak_pages)

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        m = lower.meta
        if m is not None:
            upper.meta = _Seen(m.birth, m.hit)

    def on_remove(self, node: TreeNode) -> None:
        m = node.meta
        if m is None:
            return
        birth = m.birth
        if not birth.reused and not birth.wasted:  # left unused: its origin wasted the pages
            birth.wasted = True
            self._settle(birth.origin, False)
        _remember(self.ghost, node.page_keys, m.birth, int(self.GHOST_FACTOR * self.peak_pages))


def _peak_pages(tree: RadixTree, peak: int) -> int:
    return max(peak, tree.device_pages + tree.host_pages)


def _remember(ghost: OrderedDict[bytes, Any], page_keys: Sequence[bytes], value: Any, cap: int) -> None:
    """Put ``page_keys`` (with ``value``) at the new end of a ghost list, then forget its oldest keys
    beyond ``cap``."""
    for pk in page_keys:
        ghost[pk] = value
        ghost.move_to_end(pk)
    while len(ghost) > cap:
        ghost.popitem(last=False)


class _ArcMeta:
    """``TreeNode.meta`` under :class:`ARC`: whether the node is in T2 (hit since it entered the tree)."""

    __slots__ = ("t2",)

    def __init__(self, t2: bool) -> None:
        self.t2 = t2


@register_policy("arc")
class ARC(EvictionPolicy):
    """ARC (Megiddo and Modha, adaptive replacement cache) on the leaves of the prefix tree, counted in pages.

    Contract. Every node the policy saw enter the tree is in one of two lists: T1, nodes no request has
    hit since they entered, and T2, nodes hit at least once. Two ghost lists remember the page keys of
    pages that left the tree: B1 those that left from T1, B2 those from T2, each at most the most pages
    the tree has held (``peak``), oldest forgotten first. A new leaf holding a page of B1 raises the
    target size ``p`` of T1 by ``max(1, |B2| / |B1|)`` x its pages (recency would have kept it); one
    holding a page of B2 lowers ``p`` by ``max(1, |B1| / |B2|)`` x its pages (frequency would have); both
    kinds start in T2 and leave the ghost list. ``0 <= p <= peak``. Order: while T1 holds more than ``p``
    pages, T1 nodes go first, otherwise T2 nodes first; least recently used first within each list.
    Keys are taken when an eviction starts (the tree heaps them once), so one eviction call uses one
    order. Nodes the policy never saw (none in practice) count as T2.

    Why: ARC splits the cache between new content and content that proved itself, and learns the split
    from its own mistakes, with no tuning. Measured (``benchmarks/hit_rate.py`` workloads, share of the
    offline optimum at 10% / 30% of the working set, seeds 0 / 1): RAG 92-93% / 96-98%, few-shot
    100% / 100%, multi-turn 80% / 99% (seed 0) and 63% / 98% (seed 1), Mooncake 52% / 78% -- close to
    ``reuse_lru`` but not ahead of it (slightly better on RAG at seed 0 and Mooncake at 30%, worse on
    multi-turn chat and Mooncake at 10%).

    Cost: O(1) per key and hook; inserting or removing a leaf is O(its pages) ghost look-ups; the ghosts
    hold at most 2 x ``peak`` page keys.
    """

    def bind(self, tree: RadixTree) -> None:
        self.tree = tree
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self.t1_pages = 0  # pages of T1 nodes in the tree
        self.p = 0.0  # target pages of T1
        self.peak = 1

    def in_t2(self, node: TreeNode) -> bool:
        m = node.meta
        return m is None or bool(m.t2)

    def key(self, node: TreeNode) -> Any:
        t1_first = self.t1_pages > self.p
        return (self.in_t2(node) == t1_first, node.last_access)

    def on_match(self, node: TreeNode, now: int) -> None:
        m = node.meta
        if m is not None and not m.t2:
            m.t2 = True
            self.t1_pages -= node.n_pages

    def on_insert(self, node: TreeNode, now: int, created: bool) -> None:
        if not created:
            return
        g1 = g2 = 0  # pages of the leaf found in B1 / B2
        for pk in node.page_keys:
            if self.b1.pop(pk, 0) is None:
                g1 += 1
            elif self.b2.pop(pk, 0) is None:
                g2 += 1
        self.peak = _peak_pages(self.tree, self.peak)
        b1, b2 = max(len(self.b1), 1), max(len(self.b2), 1)
        self.p += max(b2 / b1, 1.0) * g1 - max(b1 / b2, 1.0) * g2
        self.p = min(float(self.peak), max(0.0, self.p))
        if not (g1 or g2):
            self.t1_pages += node.n_pages
        node.meta = _ArcMeta(bool(g1 or g2))

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        m = lower.meta
        if m is not None:
            upper.meta = _ArcMeta(m.t2)  # the pages only change nodes: T1's page count stays

    def on_remove(self, node: TreeNode) -> None:
        m = node.meta
        if m is None:
            return
        if not m.t2:
            self.t1_pages -= node.n_pages
        _remember(self.b2 if m.t2 else self.b1, node.page_keys, None, self.peak)


class _Lru2Meta:
    """``TreeNode.meta`` under :class:`LRU2`: the clock of the node's last two accesses (``prev`` is -1
    when it had only one)."""

    __slots__ = ("last", "prev")

    def __init__(self, prev: int, last: int) -> None:
        self.prev = prev
        self.last = last


@register_policy("lru2")
class LRU2(EvictionPolicy):
    """LRU-K with K = 2 (O'Neil, O'Neil and Weikum): the node whose second most recent access is oldest
    goes first.

    Contract. An access of a node is a request that hit it (``match``) or the insert that created it;
    the insert of a request that already matched the node adds nothing. Nodes with one known access
    (``prev`` = -1) go before all others, least recently used first; the rest are ordered by the time of
    their second most recent access, then by the most recent. A split gives both halves the history of
    the node. The policy remembers, for the page keys of the last ``GHOST_FACTOR`` x (most pages the tree
    has held) pages that left the tree, the time of their last access; a new leaf holding one of them
    takes that time as its previous access (so content evicted between two uses is not treated as new).

    Why: a node used twice within a short time is likelier to be used again than one used once, however
    recently; LRU-2 keeps the former through a burst of one-off content. Measured (``benchmarks/hit_rate.py``
    workloads, share of the offline optimum at 10% / 30% of the working set, seeds 0 / 1): RAG 93-94% /
    97-98%, few-shot 100% / 100%, multi-turn 77% / 92% and 66% / 91%, Mooncake 51% / 78% -- it loses on
    multi-turn chat, where each turn is used once before the next extends it; ``reuse_lru`` stays ahead.

    Cost: O(1) per key and hook; inserting or removing a leaf is O(its pages) ghost look-ups.
    """

    GHOST_FACTOR = 2.0  # ghost length, in multiples of the most pages the tree has held

    def bind(self, tree: RadixTree) -> None:
        self.tree = tree
        self.ghost: OrderedDict[bytes, int] = OrderedDict()
        self.peak = 1

    def key(self, node: TreeNode) -> Any:
        m = node.meta
        if m is None:
            return (-1, node.last_access)
        return (m.prev, m.last)

    def on_match(self, node: TreeNode, now: int) -> None:
        m = node.meta
        if m is not None and now != m.last:
            m.prev, m.last = m.last, now

    def on_insert(self, node: TreeNode, now: int, created: bool) -> None:
        if not created:
            return
        prev = -1
        for pk in node.page_keys:
            t = self.ghost.pop(pk, None)
            if t is not None:
                prev = max(prev, t)
        node.meta = _Lru2Meta(prev, now)
        self.peak = _peak_pages(self.tree, self.peak)

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        m = lower.meta
        if m is not None:
            upper.meta = _Lru2Meta(m.prev, m.last)

    def on_remove(self, node: TreeNode) -> None:
        m = node.meta
        if m is None:
            return
        _remember(self.ghost, node.page_keys, m.last, int(self.GHOST_FACTOR * self.peak))
