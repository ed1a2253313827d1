"""The eviction policy interface and its registry (see :mod:`hicache.eviction`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hicache.registry import Registry

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


# a key function, or an EvictionPolicy subclass (one instance per tree)
POLICIES: Registry[Any] = Registry("eviction_policy", "policy")


def register_policy(name: str) -> Callable[[Any], Any]:
    """Decorator: make a key function or an :class:`EvictionPolicy` subclass selectable as
    ``eviction_policy: <name>``."""
    return POLICIES.register(name)


def get_policy(name: str) -> EvictionKey:
    """The key function of policy ``name`` (of a fresh instance, for a stateful policy)."""
    return make_policy(name).key


def make_policy(name: str) -> EvictionPolicy:
    """A policy instance for one tree."""
    entry = POLICIES.get(name)
    if isinstance(entry, type) and issubclass(entry, EvictionPolicy):
        return entry()
    return _KeyPolicy(entry)


def policy_names() -> list[str]:
    return POLICIES.names()


def peak_pages(tree: RadixTree, peak: int) -> int:
    """The most pages ``tree`` has held (L1 + L2), given the most seen so far: a ghost list's scale."""
    return max(peak, tree.device_pages + tree.host_pages)


def remember(ghost: OrderedDict[bytes, Any], page_keys: Sequence[bytes], value: Any, cap: int) -> None:
    """Put ``page_keys`` (with ``value``) at the new end of a ghost list, then forget its oldest keys
    beyond ``cap``."""
    for pk in page_keys:
        ghost[pk] = value
        ghost.move_to_end(pk)
    while len(ghost) > cap:
        ghost.popitem(last=False)
