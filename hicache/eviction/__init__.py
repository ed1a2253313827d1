"""Eviction order: a registry of policies.

A policy maps a tree node to a sort key; the node with the *smallest* key is evicted first. Policies
see only what the node records (``last_access``, ``hit_count``, ``priority``, ``n_pages``), so they are
online: they know nothing of future requests.

A policy is either a key function (``@register_policy`` on a function) or a stateful
:class:`EvictionPolicy` subclass (``@register_policy`` on the class): the tree builds one instance of it,
binds it to itself and tells it, as they happen, of matches, inserts, splits and removals, so it can
keep its own per-node state (``TreeNode.meta``) and per-tree state (e.g. what it evicted lately).

Modules: :mod:`~hicache.eviction.base` (the interface and the registry), :mod:`~hicache.eviction.keyed`
(``lru``, ``lfu``, ``priority``, ``tail_lru``), :mod:`~hicache.eviction.reuse` (``reuse_lru``, the
default) and :mod:`~hicache.eviction.ghost` (``arc``, ``lru2``). Importing this package registers them all.
"""

from hicache.eviction.base import (
    EvictionKey,
    EvictionPolicy,
    get_policy,
    make_policy,
    policy_names,
    register_policy,
)
from hicache.eviction.ghost import ARC, LRU2
from hicache.eviction.keyed import ONE_OFF_SAMPLE, ONE_OFF_SHARE, is_one_off_tail, lfu, lru, priority, tail_lru
from hicache.eviction.reuse import ReuseLRU

__all__ = [
    "ARC", "LRU2", "ONE_OFF_SAMPLE", "ONE_OFF_SHARE", "EvictionKey", "EvictionPolicy", "ReuseLRU", "get_policy",
    "is_one_off_tail", "lfu", "lru", "make_policy", "policy_names", "priority", "register_policy", "tail_lru",
]
