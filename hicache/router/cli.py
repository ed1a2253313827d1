"""``hicache route``: run the cache-aware router in front of node services.

    hicache route --node gpu0=10.0.0.1:50051 --node gpu1=10.0.0.2:50051 [--config FILE] [--port 50061]

The config FILE can be the nodes' own (``model`` and ``layout`` must be the nodes': the router computes
the same page keys) plus a ``router`` section (see :mod:`hicache.router.config`). ``--node`` flags
replace the file's node list. Precedence: file < ``HICACHE_ROUTER__<FIELD>`` / ``HICACHE_MODEL__...``
environment < flags. Prints ``hicache route: listening on HOST:PORT`` when up; SIGTERM stops it.

With ``--index approximate`` the router reads no event stream and polls nothing: it predicts what each
node caches from the requests it sent there, so the nodes can be any engine that serves the routed
requests. The default, ``--index events``, follows each hicache node's event stream and knows.

A node that is a vLLM or SGLang engine rather than a hicache node is followed through the engine's own KV
events: ``--kv-events NAME=tcp://HOST:5557`` (its ZeroMQ publisher; ``--kv-events-replay NAME=tcp://HOST:5558``
to fill gaps from the publisher's buffer). Its ``--node`` address is where clients send its requests, and
where its Prometheus page (``/metrics``) tells the router its load.

Node addresses are checked as ``hicache status`` checks its target (:mod:`hicache.client.address`): a malformed
``host:port``, a port outside 1-65535, an empty entry, a name or an address given twice exits with code 2
and one line naming the flag (or ``router.nodes``, or the ``HICACHE_ROUTER__NODES`` variable).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from hicache.cli import HelpFormatter
from hicache.config import ConfigError
from hicache.config_load import blame_env
from hicache.router.config import INDEX_MODES, check_nodes, load_router_config, parse_node
from hicache.router.scoring import policy_names
from hicache.service.preflight import check_host, check_pem_file, check_tls

# flag dest -> (section, field)
_FLAGS: dict[str, tuple[str, str]] = {
    "host": ("router", "host"),
    "port": ("router", "port"),
    "metrics_port": ("router", "metrics_port"),
    "metrics_host": ("router", "metrics_host"),
    "policy": ("router", "policy"),
    "index": ("router", "index"),
    "approx_ttl_s": ("router", "approx_ttl_s"),
    "approx_capacity_tokens": ("router", "approx_capacity_tokens"),
    "load_weight": ("router", "load_weight"),
    "min_prefix_score": ("router", "min_prefix_score"),
    "balance_abs_threshold": ("router", "balance_abs_threshold"),
    "balance_rel_threshold": ("router", "balance_rel_threshold"),
    "route_ttl_s": ("router", "route_ttl_s"),
    "stats_interval_s": ("router", "stats_interval_s"),
    "auth_token": ("router", "auth_token"),
    "auth_tokens_file": ("router", "auth_tokens_file"),
    "node_token": ("router", "node_token"),
    "model": ("model", "name"),
    "revision": ("model", "revision"),
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "route", help="run the cache-aware router over node services", description=__doc__,
        formatter_class=HelpFormatter)
    p.add_argument("--node", action="append", metavar="NAME=HOST:PORT", default=None,
                   help="a node service (repeat for each node)")
    p.add_argument("--kv-events", action="append", metavar="NAME=ENDPOINT", default=None,
                   help="node NAME is a vLLM / SGLang engine: follow its ZeroMQ KV-event publisher (repeat per "
                        "engine)")
    p.add_argument("--kv-events-replay", action="append", metavar="NAME=ENDPOINT", default=None,
                   help="the replay endpoint of NAME's publisher: batches missed in a gap are asked for there")
    p.add_argument("--config", metavar="FILE", help="YAML config (model, layout and router sections)")
    g = p.add_argument_group("overrides (win over the file and the environment)")
    g.add_argument("--host")
    g.add_argument("--port", type=int)
    g.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0: off)")
    g.add_argument("--metrics-host", help="address /metrics binds (default 127.0.0.1, whatever --host; its "
                                          "bearer token: HICACHE_ROUTER__METRICS_TOKEN)")
    g.add_argument("--policy", choices=policy_names())
    g.add_argument("--index", choices=INDEX_MODES,
                   help="events: follow each node's event stream (hicache nodes); approximate: predict each "
                        "node's cache from the routes, with no traffic to the nodes (any engine)")
    g.add_argument("--approx-ttl-s", type=float, help="approximate: forget a predicted page not routed again by then")
    g.add_argument("--approx-capacity-tokens", type=int, help="approximate: tokens predicted per node, at most")
    g.add_argument("--load-weight", type=float, help="cost of one queued request, in full prefills")
    g.add_argument("--min-prefix-score", type=float, help="prefixes under this share of the request count as none")
    g.add_argument("--balance-abs-threshold", type=float, help="hot spot: load above the least loaded by this")
    g.add_argument("--balance-rel-threshold", type=float, help="... and above this times the least loaded")
    g.add_argument("--route-ttl-s", type=float, help="routes not completed by then stop counting as load")
    g.add_argument("--stats-interval-s", type=float)
    g.add_argument("--auth-token", help="require 'authorization: Bearer TOKEN' (prefer HICACHE_ROUTER__AUTH_TOKEN)")
    g.add_argument("--auth-tokens-file", metavar="FILE",
                   help="tokens mapped to the tenants each may route for (the node's serve.auth_tokens_file "
                        "format); --auth-token is then an admin token")
    g.add_argument("--node-token", help="bearer token for the nodes (prefer HICACHE_ROUTER__NODE_TOKEN)")
    g.add_argument("--model")
    g.add_argument("--revision")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def overrides_from_args(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for dest, (section, name) in _FLAGS.items():
        v = getattr(args, dest, None)
        if v is not None:
            out.setdefault(section, {})[name] = v
    if args.node:
        out.setdefault("router", {})["nodes"] = list(args.node)
    for dest in ("kv_events", "kv_events_replay"):
        pairs = getattr(args, dest, None)
        if pairs:
            out.setdefault("router", {})[dest] = dict(_pair(p, "--" + dest.replace("_", "-")) for p in pairs)
    return out


def _pair(text: str, flag: str) -> tuple[str, str]:
    name, sep, endpoint = text.partition("=")
    if not sep or not name:
        raise ConfigError(f"{flag}: {text!r}: expected NAME=ENDPOINT (tcp://HOST:PORT)", flag)
    return name.strip(), endpoint.strip()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.node:  # checked here too, so that the message names the flag rather than router.nodes
        try:
            check_nodes([parse_node(text, "--node") for text in args.node], "--node")
        except ConfigError as e:
            print(f"hicache route: {e}", file=sys.stderr)
            return 2
    try:
        overrides = overrides_from_args(args)
    except ConfigError as e:
        print(f"hicache route: {e}", file=sys.stderr)
        return 2
    config, rconfig = load_router_config(args.config, overrides=overrides)
    if not rconfig.nodes:
        print("hicache route: no nodes: pass --node NAME=host:port (or router.nodes in --config)", file=sys.stderr)
        return 2
    from hicache.service.auth import Authenticator

    try:  # what this machine must offer (hicache.service.preflight)
        check_host(rconfig.host, "router.host")
        if rconfig.metrics_port:
            check_host(rconfig.metrics_host, "router.metrics_host")
        # the server's files load and match (a bad key is named here, not blamed on the port by the bind)
        check_tls(rconfig.tls_cert, rconfig.tls_key, rconfig.tls_client_ca, "router")
        for name in ("node_tls_ca", "node_client_cert", "node_client_key"):
            if getattr(rconfig, name):
                check_pem_file(getattr(rconfig, name), f"router.{name}")
        # a bad tokens file: one line naming the entry (never a token), before anything starts
        Authenticator.for_serve(rconfig.auth_token, rconfig.auth_tokens_file, "router")
    except ConfigError as e:
        raise blame_env(e, os.environ, overrides) from None
    from hicache.router.server import run as run_server

    return run_server(config, rconfig)
