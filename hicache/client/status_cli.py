"""``hicache status``: what a running node or router holds and does, from its ``Stats`` / ``ListNodes`` RPCs.

    hicache status 10.0.0.1:50051                  # a node: pools, hit rate by tier, L3, open requests
    hicache status 10.0.0.1:50061 --watch 2        # a router: its nodes, every 2 s
    hicache status 10.0.0.1:50051 --json --watch 5 --count 12   # one JSON object per line

The target's kind is asked, not told: a router answers ``ListNodes``, a node does not. With ``--watch``
the rates (lookups/s, the hit rate of the last interval, routes/s) come from the difference between two
readings. Exit codes: 0; 1 when the target cannot be reached or refuses the call (one line on stderr);
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict
from typing import Any

import grpc

from hicache.client._common import ChannelSettings
from hicache.client.address import PORT_RANGE, AddressError, normalize_address
from hicache.client.types import Stats
from hicache.config import ConfigError, token_problem
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc
from hicache.service.preflight import check_pem_file

DESCRIPTION = """\
Show what a running node (hicache serve) or router (hicache route) holds and does, read from its Stats or
ListNodes call: a node's pools, hit rate by tier, L3 traffic and open requests; a router's nodes (in sync,
breaker, in flight, pages indexed, requests routed).

examples:
  hicache status 10.0.0.1:50051                  a node
  hicache status 10.0.0.1:50061 --watch 2        a router, every 2 s, with routes/s per node
  hicache status 10.0.0.1:50051 --json --watch 5 --count 12

exit codes: 0; 1 when the target cannot be reached or refuses the call; 2 for bad arguments."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="show what a running node or router holds and does",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="host:port (or grpc://host:port) of a node (hicache serve) or a router")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="read again every SECONDS (rates per interval)")
    p.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N readings")
    p.add_argument("--json", action="store_true", help="one JSON object per reading on stdout")
    p.add_argument("--token-env", default="HICACHE_TOKEN", metavar="VAR",
                   help="environment variable holding the bearer token, if the target wants one "
                        "(default HICACHE_TOKEN)")
    p.add_argument("--tls-ca", metavar="PEM", help="connect over TLS, trusting this CA")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="per call (default 5)")


class StatusError(Exception):
    """The target could not be read (printed as one line, exit code 1)."""


class Probe:
    """One channel to the target; :meth:`read` returns ``("node" | "router", reading)``."""

    def __init__(self, target: str, token: str, tls_ca: str, timeout_s: float) -> None:
        self.target = target
        s = ChannelSettings(target, token, tls_ca)
        creds = s.credentials()
        self.channel = (grpc.secure_channel(target, creds, options=s.options()) if creds is not None
                        else grpc.insecure_channel(target, options=s.options()))
        self.md = s.metadata()
        self.timeout_s = timeout_s
        self.kind = ""

    def _call(self, fn: Any, req: Any) -> Any:
        try:
            return fn(req, timeout=self.timeout_s, metadata=self.md, wait_for_ready=not self.kind)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED and not self.kind:
                raise
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise StatusError(f"{self.target}: nothing answering there ({e.code().name})") from None
            raise StatusError(f"{self.target}: {e.code().name}: {e.details()}") from None

    def read(self) -> tuple[str, Any]:
        if self.kind in ("", "router"):
            try:
                resp = self._call(rpb_grpc.RouterStub(self.channel).ListNodes, rpb.ListNodesRequest())
                self.kind = "router"
                return "router", resp
            except grpc.RpcError:  # UNIMPLEMENTED: not a router
                self.kind = "node"
        return "node", Stats.from_pb(self._call(pb_grpc.HiCacheStub(self.channel).Stats, pb.StatsRequest()))

    def close(self) -> None:
        self.channel.close()


def _pct(a: float, b: float) -> float | None:
    return a / b if b else None


def node_view(st: Stats, prev: Stats | None, dt: float) -> dict[str, Any]:
    """A node's reading as a flat dict; ``interval`` holds rates since ``prev`` (``dt`` seconds before)."""
    hits = st.hit_tokens_l1 + st.hit_tokens_l2 + st.hit_tokens_l3
    out: dict[str, Any] = {"kind": "node", "stats": asdict(st),
                           "hit_rate": _pct(hits, st.lookup_tokens),
                           "hit_rate_by_tier": {t: _pct(getattr(st, f"hit_tokens_{t}"), st.lookup_tokens)
                                                for t in ("l1", "l2", "l3")},
                           "l1_used": _pct(st.l1_pages_used, st.l1_pages_total),
                           "l2_used": _pct(st.l2_pages_used, st.l2_pages_total)}
    if prev is not None and dt > 0:
        d_tok = st.lookup_tokens - prev.lookup_tokens
        d_hit = hits - (prev.hit_tokens_l1 + prev.hit_tokens_l2 + prev.hit_tokens_l3)
        out["interval"] = {"seconds": dt, "lookups_per_s": (st.lookups - prev.lookups) / dt,
                           "lookup_tokens_per_s": d_tok / dt, "hit_rate": _pct(d_hit, d_tok),
                           "l3_pages_written_per_s": (st.storage_pages_written - prev.storage_pages_written) / dt,
                           "l3_pages_read_per_s": (st.storage_pages_read - prev.storage_pages_read) / dt}
    return out


def router_view(resp: rpb.ListNodesResponse, prev: rpb.ListNodesResponse | None, dt: float) -> dict[str, Any]:
    before = {n.name: n.routed for n in prev.nodes} if prev is not None else {}
    nodes = []
    for n in resp.nodes:
        row: dict[str, Any] = {"name": n.name, "address": n.address, "connected": n.connected,
                               "breaker": n.breaker, "namespace_ok": n.namespace_ok, "l1_pages": n.l1_pages,
                               "l2_pages": n.l2_pages, "in_flight": n.in_flight, "queue_depth": n.queue_depth,
                               "routed": n.routed, "resyncs": n.resyncs, "last_error": n.last_error}
        if prev is not None and dt > 0:
            row["routes_per_s"] = (n.routed - before.get(n.name, n.routed)) / dt
        nodes.append(row)
    return {"kind": "router", "namespace": resp.namespace, "index": resp.index or "events", "nodes": nodes}


def _f(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _stored(s: dict[str, Any]) -> str:
    """How L3 stores the pages written, when compression saved space."""
    written, stored = s.get("storage_bytes_written", 0), s.get("storage_stored_bytes_written", 0)
    if not stored or stored >= written:
        return ""
    return f"; L3 pages stored compressed {written / stored:.2f}x ({stored} of {written} bytes)"


def render(view: dict[str, Any], target: str) -> str:
    """The human-readable form of a view (plain text, one screen)."""
    if view["kind"] == "node":
        s = view["stats"]
        by = view["hit_rate_by_tier"]
        lines = [f"node {target}",
                 f"  L1 {s['l1_pages_used']}/{s['l1_pages_total']} pages used ({_f(view['l1_used'])}): "
                 f"{s['l1_pages_cached']} cached, {s['l1_pages_locked']} locked",
                 f"  L2 {s['l2_pages_used']}/{s['l2_pages_total']} pages used ({_f(view['l2_used'])}): "
                 f"{s['l2_pages_cached']} cached",
                 f"  hit rate {_f(view['hit_rate'])} of {s['lookup_tokens']} tokens looked up in {s['lookups']} "
                 f"matches (L1 {_f(by['l1'])}, L2 {_f(by['l2'])}, L3 {_f(by['l3'])})",
                 f"  L3 {s['storage_pages_written']} pages written, {s['storage_pages_read']} read, "
                 f"{s['storage_errors']} errors, {s['storage_corrupt_pages']} corrupt; writeback queue "
                 f"{s['writeback_queue_pages']} pages" + _stored(s),
                 f"  {s['open_requests']} open requests; {s['pins']} pins holding {s['pinned_l1_pages']} L1 / "
                 f"{s['pinned_l2_pages']} L2 pages; event sequence {s['event_sequence']}"]
        iv = view.get("interval")
        if iv:
            lines.append(f"  last {iv['seconds']:.1f} s: {iv['lookups_per_s']:.1f} matches/s, "
                         f"{iv['lookup_tokens_per_s']:.0f} tokens/s, hit rate {_f(iv['hit_rate'])}, "
                         f"L3 {iv['l3_pages_written_per_s']:.1f} pages/s written, "
                         f"{iv['l3_pages_read_per_s']:.1f} read")
        return "\n".join(lines)
    head = f"{'node':<16} {'address':<22} {'sync':<5} {'breaker':<9} {'L1 pages':>9} {'L2 pages':>9} " \
           f"{'in flight':>9} {'queue':>6} {'routed':>8}"
    approx = view.get("index") == "approximate"
    index = "  approximate index (pages predicted from the routes; no event streams)" if approx else ""
    rows = [f"router {target}  namespace {view['namespace']}{index}", head]
    for n in view["nodes"]:
        sync = "-" if approx else "yes" if n["connected"] else "NO"
        if not n["namespace_ok"]:
            sync = "ns!"
        rate = f" ({n['routes_per_s']:.1f}/s)" if "routes_per_s" in n else ""
        rows.append(f"{n['name']:<16} {n['address']:<22} {sync:<5} {n['breaker']:<9} {n['l1_pages']:>9} "
                    f"{n['l2_pages']:>9} {n['in_flight']:>9} {n['queue_depth']:>6} {n['routed']:>8}{rate}"
                    + (f"  last error: {n['last_error']}" if n["last_error"] else ""))
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    try:
        target = normalize_address(args.target)
    except AddressError as e:
        print(f"hicache status: target {args.target!r}: {e} (expected host:port, {PORT_RANGE})", file=sys.stderr)
        return 2
    if args.watch is not None and not (math.isfinite(args.watch) and args.watch > 0):
        print("hicache status: --watch: must be a finite number > 0 seconds", file=sys.stderr)
        return 2
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        print("hicache status: --timeout: must be a finite number > 0 seconds", file=sys.stderr)
        return 2
    if args.count is not None and (args.count < 1 or args.watch is None):
        print("hicache status: --count: needs --watch and a count >= 1", file=sys.stderr)
        return 2
    token = os.environ.get(args.token_env, "")
    why = token_problem(token)
    if why is not None:
        print(f"hicache status: {args.token_env}: {why}", file=sys.stderr)
        return 2
    if args.tls_ca:
        try:
            check_pem_file(args.tls_ca, "--tls-ca")
        except ConfigError as e:
            print(f"hicache status: {e}", file=sys.stderr)
            return 2
    probe = Probe(target, token, args.tls_ca or "", args.timeout)
    prev: Any = None
    t_prev = 0.0
    n = 0
    try:
        while True:
            kind, reading = probe.read()
            now = time.monotonic()
            view = (node_view(reading, prev, now - t_prev) if kind == "node"
                    else router_view(reading, prev, now - t_prev))
            print(json.dumps(view) if args.json else render(view, target), flush=True)
            n += 1
            if args.watch is None or (args.count is not None and n >= args.count):
                return 0
            prev, t_prev = reading, now
            time.sleep(args.watch)
            if not args.json:
                print()
    except StatusError as e:
        print(f"hicache status: {e}", file=sys.stderr)
        return 1
    finally:
        probe.close()
