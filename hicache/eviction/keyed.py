"""Stateless policies: a key function of what a node records (``@register_policy`` on a function)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from hicache.eviction.base import register_policy

if TYPE_CHECKING:
    from hicache.radix import TreeNode


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
