"""Eviction order: a registry of policies.

A policy maps a tree node to a sort key; the node with the *smallest* key is evicted first. Policies
see only what the node records (``last_access``, ``hit_count``, ``priority``, ``n_pages``), so they are
online: they know nothing of future requests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.radix import TreeNode

EvictionKey = Callable[["TreeNode"], Any]

_POLICIES: dict[str, EvictionKey] = {}


def register_policy(name: str) -> Callable[[EvictionKey], EvictionKey]:
    """Decorator: make ``fn`` selectable as ``eviction_policy: <name>``."""

    def deco(fn: EvictionKey) -> EvictionKey:
        _POLICIES[name] = fn
        return fn

    return deco


def get_policy(name: str) -> EvictionKey:
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(f"eviction_policy: unknown policy {name!r}; known: {sorted(_POLICIES)}") from None


def policy_names() -> list[str]:
    return sorted(_POLICIES)


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
