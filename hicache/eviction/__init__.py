"""Eviction order: a registry of policies.

A policy maps a tree node to a sort key; the node with the *smallest* key is evicted first. Policies
see only what the node records (``last_access``, ``hit_count``, ``priority``, ``n_pages``), so they are
online: they know nothing of future requests.

A policy is either a key function (``@register_policy`` on a function) or a stateful
:class:`EvictionPolicy` subclass (``@register_policy`` on the class): the tree builds one instance of it,
binds it to itself and tells it, as they happen, of matches, inserts, splits and removals, so it can
keep its own per-node state (``TreeNode.meta``) and per-tree state (e.g. what it evicted lately).

Modules: :mod:`~hicache.eviction.base` (the interface and the registry), :mod:`~hicache.eviction.keyed`
(``lru``, ``lfu``, ``priority``), :mod:`~hicache.eviction.hedge` (``hedge_lru``, the default),
:mod:`~hicache.eviction.reuse` (``reuse_lru``) and :mod:`~hicache.eviction.ghost` (``arc``). Importing this
package registers them all. ``tail_lru`` and ``lru2`` left the package (behind LRU on held-out traces and
never more than a point ahead of ``hedge_lru``); ``benchmarks/policy_eval.py`` still compares them.
"""

from hicache.eviction.base import (
    EvictionKey,
    EvictionPolicy,
    get_policy,
    make_policy,
    policy_names,
    register_policy,
)
from hicache.eviction.ghost import ARC
from hicache.eviction.hedge import HedgeLRU
from hicache.eviction.keyed import lfu, lru, priority
from hicache.eviction.reuse import ReuseLRU

__all__ = [
    "ARC", "EvictionKey", "EvictionPolicy", "HedgeLRU", "ReuseLRU", "get_policy", "lfu", "lru", "make_policy",
    "policy_names", "priority", "register_policy",
]
