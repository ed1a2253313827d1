"""Router configuration: the ``router`` section, next to the nodes' ``model`` / ``layout`` sections.

The router must compute the same page keys as the nodes, so it reads the same ``model`` (name, revision,
tenant, TP shard) and ``layout`` sections; a node config file can be reused as is (its ``cache``,
``storage`` and ``serve`` sections are validated and ignored). Its own settings live in ``router``::

    model: {name: llama-3.1-8b, revision: 0e9e39f}
    layout: {num_layers: 32, num_kv_heads: 8, head_dim: 128, dtype: bfloat16, page_size: 64}
    router:
      port: 50061
      nodes: ["gpu0=10.0.0.1:50051", "gpu1=10.0.0.2:50051"]   # or a mapping {gpu0: "10.0.0.1:50051"}
      policy: cache_aware
      index: events          # or approximate: predict each node's cache from the routes (no event streams)
      kv_events: {gpu2: "tcp://10.0.0.3:5557"}   # gpu2 is a vLLM / SGLang engine: follow its own KV events

Precedence: the YAML file < environment ``HICACHE_<SECTION>__<FIELD>`` (``HICACHE_ROUTER__POLICY=...``)
< explicit overrides (CLI flags). Every bad value raises :class:`hicache.config.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from hicache.client.address import PORT_RANGE, AddressError, normalize_address
from hicache.config import ConfigError, HiCacheConfig, config_from_dict, token_problem
from hicache.config_load import blame_env, coerce, env_overrides, merge, read_config_file, require
from hicache.router.scoring import ScoringParams, policy_names

INDEX_MODES = ("events", "approximate")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_ENDPOINT = re.compile(r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})|ipc://.+)$")


class NodeSpec(NamedTuple):
    name: str  # unique; [A-Za-z0-9_.-] when given, else the address itself
    address: str  # host:port of the node service, as hicache.client.address.normalize_address writes it


def parse_node(text: str, where: str = "router.nodes") -> NodeSpec:
    """``NAME=host:port`` -> NodeSpec (a bare ``host:port`` is its own name). The address is checked as
    ``hicache status`` checks its target (:func:`hicache.client.address.parse_address`) and kept in that form
    (no ``grpc://``); ``where`` (the config field, or a flag) starts the error message."""
    name, sep, addr = text.partition("=")
    if not sep:
        name, addr = "", text
    name = name.strip()
    try:
        address = normalize_address(addr)
    except AddressError as e:
        raise ConfigError(f"{where}: {text!r}: {e} (expected NAME=host:port, {PORT_RANGE})", where) from None
    if sep and not _NAME.match(name):
        raise ConfigError(f"{where}: {text!r}: bad node name {name!r} (letters, digits, '_', '.', '-')", where)
    return NodeSpec(name or address, address)


def endpoint_problem(endpoint: Any) -> str:
    """Why ``endpoint`` is not a ZeroMQ endpoint the router can connect to ("" : it is)."""
    m = _ENDPOINT.match(endpoint) if isinstance(endpoint, str) else None
    if m is None:
        if isinstance(endpoint, str) and endpoint.startswith("tcp://*"):
            return "'*' binds on the engine's side; connect to the engine's host (tcp://HOST:PORT)"
        return "not a ZeroMQ endpoint to connect to (tcp://HOST:PORT or ipc://PATH)"
    if m[3] is not None and not 1 <= int(m[3]) <= 65535:
        return "port must be in 1-65535"
    return ""


def check_nodes(nodes: list[NodeSpec], where: str = "router.nodes") -> None:
    """Refuse a node list naming one node twice: two entries with one name, or one address under two names
    (the router would count each page and each request of that node twice)."""
    names = [n.name for n in nodes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{where}: node names must be unique, repeated: {dup}", where)
    seen: dict[str, str] = {}
    for n in nodes:
        key = n.address.lower()
        if key in seen:
            raise ConfigError(f"{where}: {n.address} is listed twice (as {seen[key]!r} and {n.name!r})", where)
        seen[key] = n.name


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50061
    metrics_port: int = 0  # Prometheus /metrics (0: off)
    metrics_host: str = "127.0.0.1"  # /metrics binds here, not router.host: loopback unless Prometheus is elsewhere
    metrics_token: str = ""  # bearer token /metrics requires ("": none)
    metrics_tls: bool = False  # serve /metrics over HTTPS with router.tls_cert / tls_key
    nodes: list[NodeSpec] = field(default_factory=list)
    policy: str = "cache_aware"
    index: str = "events"  # events: follow each node's WatchEvents | approximate: predict from the routes
    approx_ttl_s: float = 120.0  # approximate: a predicted page not routed again by then is forgotten
    approx_capacity_tokens: int = 1 << 20  # approximate: tokens predicted per node, at most (LRU beyond)
    load_weight: float = 0.1  # cost of one queued request, in full prefills
    l2_weight: float = 0.9  # an L2 page's worth relative to an L1 page
    min_prefix_score: float = 0.2  # a prefix under this share of the request counts as none
    balance_abs_threshold: float = 8.0  # hot-spot protection (see hicache.router.scoring)
    balance_rel_threshold: float = 1.5
    route_ttl_s: float = 120.0  # a route not completed by then stops counting as load
    stats_interval_s: float = 1.0  # poll each node's Stats (queue depth) this often
    breaker_failures: int = 5  # consecutive transport failures that open a node's breaker
    breaker_cooldown_s: float = 5.0
    breaker_max_cooldown_s: float = 60.0
    reconnect_max_s: float = 5.0  # event-stream reconnect backoff cap
    event_queue: int = 0  # WatchEvents max_queue (0: the node's default)
    verify_keys: bool = True  # recompute stored runs' keys from their tokens
    max_request_tokens: int = 1 << 20
    node_token: str = ""  # bearer token for the nodes (prefer HICACHE_ROUTER__NODE_TOKEN)
    node_tls_ca: str = ""  # PEM: reach the nodes over TLS trusting this CA
    node_client_cert: str = ""  # PEM pair for mTLS to the nodes
    node_client_key: str = ""
    auth_token: str = ""  # require this bearer token from the router's clients (with auth_tokens_file: an admin one)
    auth_tokens_file: str = ""  # YAML: tokens -> the tenants each may route for (hicache.service.auth format)
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    shutdown_grace_s: float = 5.0
    # engines followed through their own KV events (vLLM / SGLang ZeroMQ publishers) instead of a hicache
    # node's WatchEvents: node name -> publisher endpoint, and optionally -> its replay endpoint
    kv_events: dict[str, str] = field(default_factory=dict)
    kv_events_replay: dict[str, str] = field(default_factory=dict)
    kv_events_topic: str = ""  # subscribe to this topic prefix ("" : every topic)
    # engines' load: their Prometheus page at http://ADDRESS<path>, read every stats_interval_s ("" : not read)
    engine_metrics_path: str = "/metrics"

    def __post_init__(self) -> None:
        self.nodes = [n if isinstance(n, NodeSpec) else parse_node(str(n)) for n in self.nodes]
        check_nodes(self.nodes)
        if not 0 <= self.port < 65536:
            raise ConfigError(f"router.port: must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"router.metrics_port: must be in [0, 65535], got {self.metrics_port}")
        if self.policy not in policy_names():
            raise ConfigError(f"router.policy: must be one of {policy_names()}, got {self.policy!r}")
        if self.index not in INDEX_MODES:
            raise ConfigError(f"router.index: must be one of {list(INDEX_MODES)}, got {self.index!r}")
        if self.approx_capacity_tokens < 1:
            raise ConfigError(f"router.approx_capacity_tokens: must be >= 1, got {self.approx_capacity_tokens}")
        # NaN passes every comparison below, and an infinite time never elapses: both are refused
        for f in ("load_weight", "l2_weight", "min_prefix_score", "balance_abs_threshold", "balance_rel_threshold",
                  "breaker_max_cooldown_s"):
            if not math.isfinite(getattr(self, f)):
                raise ConfigError(f"router.{f}: must be a finite number, got {getattr(self, f)!r}")
        for f in ("route_ttl_s", "approx_ttl_s", "stats_interval_s", "breaker_cooldown_s", "reconnect_max_s",
                  "shutdown_grace_s"):
            if not (math.isfinite(getattr(self, f)) and getattr(self, f) > 0):
                raise ConfigError(f"router.{f}: must be a finite number > 0, got {getattr(self, f)!r}")
        if self.breaker_failures < 1:
            raise ConfigError(f"router.breaker_failures: must be >= 1, got {self.breaker_failures}")
        if self.event_queue < 0:
            raise ConfigError(f"router.event_queue: must be >= 0 (0: the node's default), got {self.event_queue}")
        if self.max_request_tokens < 1:
            raise ConfigError(f"router.max_request_tokens: must be >= 1, got {self.max_request_tokens}")
        if self.breaker_max_cooldown_s < self.breaker_cooldown_s:
            raise ConfigError("router.breaker_max_cooldown_s: must be >= breaker_cooldown_s")
        if not self.metrics_host:
            raise ConfigError("router.metrics_host: must be an address to bind /metrics on", "router.metrics_host")
        for f in ("auth_token", "node_token", "metrics_token"):
            why = token_problem(getattr(self, f))
            if why is not None:
                raise ConfigError(f"router.{f}: {why}", f"router.{f}")
        self._check_kv_events()
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("router.tls_key: set together with router.tls_cert")
        require(not self.metrics_tls or bool(self.tls_cert), "router.metrics_tls",
                "set only with router.tls_cert and router.tls_key (the certificate it serves)", self.metrics_tls)
        try:
            _ = self.scoring
        except ValueError as e:
            raise ConfigError(f"router.{e}") from None

    def _check_kv_events(self) -> None:
        names = {n.name for n in self.nodes}
        for f in ("kv_events", "kv_events_replay"):
            value = getattr(self, f)
            if not isinstance(value, dict):
                raise ConfigError(f"router.{f}: must be a mapping of node name -> ZeroMQ endpoint, got {value!r}")
            for name, endpoint in value.items():
                if name not in names:
                    raise ConfigError(f"router.{f}: {name!r} is not a node (router.nodes: {sorted(names)})",
                                      f"router.{f}")
                why = endpoint_problem(endpoint)
                if why:
                    raise ConfigError(f"router.{f}: {name}: {endpoint!r}: {why}", f"router.{f}")
        if self.engine_metrics_path and not self.engine_metrics_path.startswith("/"):
            raise ConfigError(f"router.engine_metrics_path: must start with '/' (or be empty: not read), got "
                              f"{self.engine_metrics_path!r}", "router.engine_metrics_path")
        extra = sorted(set(self.kv_events_replay) - set(self.kv_events))
        if extra:
            raise ConfigError(f"router.kv_events_replay: {extra} have no router.kv_events endpoint",
                              "router.kv_events_replay")
        if self.kv_events and self.index != "events":
            raise ConfigError("router.kv_events: the approximate index predicts from routes and follows no events; "
                              "use router.index: events", "router.kv_events")

    @property
    def scoring(self) -> ScoringParams:
        return ScoringParams(self.load_weight, self.l2_weight, self.min_prefix_score, self.balance_abs_threshold,
                             self.balance_rel_threshold)


def check_approx_capacity(rc: RouterConfig, page_size: int) -> None:
    """The approximate index predicts whole pages: ``approx_capacity_tokens`` must hold one at least."""
    if rc.index == "approximate" and rc.approx_capacity_tokens < page_size:
        raise ConfigError(f"router.approx_capacity_tokens: {rc.approx_capacity_tokens} holds no page "
                          f"(layout.page_size is {page_size})", "router.approx_capacity_tokens")


def _nodes(value: Any) -> list[NodeSpec]:
    if isinstance(value, str):
        value = [v for v in re.split(r"[,\s]+", value) if v]
    if isinstance(value, Mapping):
        return [parse_node(f"{k}={v}") for k, v in value.items()]
    if not isinstance(value, list):
        raise ConfigError(f"router.nodes: must be a list of NAME=host:port or a mapping, got {value!r}")
    return [parse_node(str(v)) for v in value]


def router_config_from_dict(values: Mapping[str, Any]) -> RouterConfig:
    hints = typing.get_type_hints(RouterConfig)
    known = {f.name for f in dataclasses.fields(RouterConfig)}
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        if name not in known:
            raise ConfigError(f"router.{name}: unknown field; known: {sorted(known)}")
        kwargs[name] = _nodes(value) if name == "nodes" else coerce("router", name, hints[name], value)
    return RouterConfig(**kwargs)


def load_router_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                       overrides: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[HiCacheConfig, RouterConfig]:
    """(the nodes' namespace config, the router's own), from YAML < environment < ``overrides``."""
    data = read_config_file(path) if path is not None else {}
    env = os.environ if env is None else env
    try:
        merged = merge(data, env_overrides(env), overrides or {})
        router = merged.pop("router", None) or {}
        if not isinstance(router, Mapping):
            raise ConfigError(f"router: must be a mapping, got {type(router).__name__}")
        config, rconfig = config_from_dict(merged), router_config_from_dict(router)
        check_approx_capacity(rconfig, config.layout.page_size)
        return config, rconfig
    except ConfigError as e:  # a bad value from HICACHE_<SECTION>__<FIELD> names that variable
        raise blame_env(e, env, overrides, file_sections=data) from None
