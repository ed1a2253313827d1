"""Cache-aware router (``hicache route``): steer each request to the node that holds its prefix.

* :mod:`.index` -- page key -> {node: tiers}, fed by every node's WatchEvents stream (snapshot, then
  gap-free deltas; resync from a fresh snapshot after a gap, a reconnect or a router restart);
* :mod:`.scoring` -- routing policies by name: ``cache_aware`` (prefix vs load, hot-spot protection),
  ``round_robin``, ``least_load``; ``@register_policy`` adds one;
* :mod:`.load` / :mod:`.breaker` -- in-flight counts that expire, reported queue depth, and a circuit
  breaker per node that counts only transport failures;
* :mod:`.config` -- the ``router`` section of the config file (nodes, policy, thresholds, TLS);
* :mod:`.core` -- :class:`Router`, the decisions without transport; :mod:`.node_feed`, :mod:`.server`,
  :mod:`.cli`, :mod:`.client` -- the gRPC side (``hicache.v1.Router``: Route / Complete / ListNodes);
* :mod:`.kv_events` / :mod:`.kv_event_feed` -- vLLM / SGLang engines followed through their own ZeroMQ KV
  events (``router.kv_events``) and their load read from their Prometheus page.
"""

from hicache.router.config import NodeSpec, RouterConfig, load_router_config
from hicache.router.core import NoNodeError, RouteDecision, Router
from hicache.router.scoring import create_policy, policy_names, register_policy

__all__ = [
    "NoNodeError",
    "NodeSpec",
    "RouteDecision",
    "Router",
    "RouterConfig",
    "create_policy",
    "load_router_config",
    "policy_names",
    "register_policy",
]
