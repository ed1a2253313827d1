"""Stateless policies: a key function of what a node records (``@register_policy`` on a function)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache.eviction.base import register_policy

if TYPE_CHECKING:
    from hicache.radix_types import TreeNode


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
