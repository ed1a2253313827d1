"""Soak test of the router's index under churn: real ``hicache serve`` nodes and a real ``hicache route``.

Three small node processes sit behind one router process. Client threads serve prompts as an engine
does: Route, then Match / Allocate / Commit / Release on the node it names, then Complete with the status
of that work; a failure on the node is reported in Complete and the request is routed again without that
node (``exclude_nodes``). Most prompts continue one of a few shared documents, so the cache-aware policy
has prefixes to follow; the rest are new.

Meanwhile a churn thread kills every node once with SIGKILL and restarts it on the same address (a new
server run with an empty cache): n2 stays down ~9 s, and n0 then n1 go down briefly in that time (so at
times only one node is up). Between kills it calls Clear on a node and pushes many new prompts straight
to one (evictions and L1 -> L2 moves the router did not cause). The router follows each node with a small
event queue (``event_queue``), so bursts of events also make the nodes drop the router's queue and
re-snapshot its stream mid-flight.

Checked:

1. after a kill the router takes the node out of rotation within ``OPEN_WITHIN_S`` (its breaker opens
   after ``breaker_failures`` failed reconnects and Stats polls; its pages leave the index at once), and
   routes nothing there from then until the restart (the breaker's cooldown outlasts every outage, so no
   half-open probe is due); after the restart the router is in sync with the new run and routes requests
   there again within ``RECOVER_WITHIN_S``, however long the node was down;
2. once the churn stops and every feed has caught up (the router's last applied event is the node's
   last event, from the node's current run), the router's index is exactly what each node holds: the
   pages indexed per tier (ListNodes) equal the node's cached pages (Stats), and for every prompt of a
   sample the prefix a peek Route reports for each node equals that node's own peek Match;
3. no request fails because of the router: Route and Complete never err, every request is eventually
   served, and every failed call on a node is explained by a kill of that node during the request
   (UNAVAILABLE, or NOT_FOUND for a request the killed run had opened). The pools are sized so that
   Allocate's documented RESOURCE_EXHAUSTED (L1 locked by requests in flight) cannot happen;
4. the router's log has no ERROR (or traceback) line: connection failures to a killed node are WARNINGs.

Minimum counts (requests served and routed per node, excluded retries, resyncs in ListNodes and
/metrics, prefixes compared on L1 and L2) keep it from passing vacuously. Fixed seeds; ~20 s on two cores.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import yaml
from cli_procs import REPO, ROUTE_READY, SERVE_READY, free_port

from hicache.client import HiCacheClient
from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc

SEED = 20240611
PS = 4
LAYOUT = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": PS}
L1_PAGES, L2_PAGES = 64, 192
NODES = ("n0", "n1", "n2")
CLIENTS = 3
DOCS, DOC_PAGES, TAIL_PAGES = 6, 5, 2  # a prompt: a shared document and its own tail, or all new
PUSH_PROMPTS, PUSH_PAGES = 24, 6  # one push: 144 new pages through a 64-page L1
# At most CLIENTS + 1 requests are open on a node at once, each holding at most 7 pages: far below L1,
# so Allocate can always evict enough (its RESOURCE_EXHAUSTED cannot happen here).
assert (CLIENTS + 1) * max(DOC_PAGES + TAIL_PAGES, PUSH_PAGES) < L1_PAGES

ROUTER = {
    "stats_interval_s": 0.2,
    "reconnect_max_s": 0.5,
    "breaker_failures": 3,
    "breaker_cooldown_s": 20.0,  # longer than any outage here: a dead node is never probed (half-open)
    "breaker_max_cooldown_s": 40.0,
    "event_queue": 16,  # small: bursts of events overflow it and the node re-snapshots the stream
    "route_ttl_s": 30.0,
}
# A killed node's event stream breaks at once and every reconnect (backoff from 50 ms) and Stats poll
# (every 0.2 s) fails: 3 failures take ~0.15 s; the rest is slack for a loaded two-core machine.
OPEN_WITHIN_S = 1.5
# After a restart the router reconnects within its backoff cap (reconnect_max_s), takes the new run's
# snapshot and routes there again (~0.5 s); the rest is slack.
RECOVER_WITHIN_S = float(ROUTER["reconnect_max_s"]) + 1.5
DOWN_S = 0.4  # how long n0 and n1 stay down before their restart begins (starting takes 1-4 s more)
LONG_DOWN_S = 9.0  # and n2: gRPC's own reconnect backoff for the node grows to several seconds meanwhile


class Proc:
    """``hicache ARGS`` in a subprocess, once it printed ``marker`` and its address. Its output is read
    all along (kept in ``lines``), so that a chatty process never blocks on a full pipe."""

    def __init__(self, args: list[str], marker: str, timeout_s: float = 60.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "hicache.cli", *args], cwd=REPO, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self.port = 0
        self.server_id = ""  # a node's run id, from its startup log line
        ready = threading.Event()

        def drain() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"hicache serve: ([0-9a-f]{16}) on ", line)
                if m:
                    self.server_id = m.group(1)
                if not self.port and line.startswith(marker):
                    self.port = int(line[len(marker):].split()[0].rsplit(":", 1)[1])
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout_s) or not self.port:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"hicache {args[0]} did not start:\n" + self.log())
        self.up_at = time.monotonic()

    def log(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Outage:
    """One kill of a node and its restart (monotonic times)."""

    node: str
    old_server: str
    killed: float  # just before SIGKILL
    opened: float = float("inf")  # ListNodes showed it out of rotation (breaker open, no pages indexed)
    up: float = float("inf")  # the restarted process listens
    recovered: float = float("inf")  # in sync with the new run, breaker closed, and routed to again


@dataclass
class Log:
    """What the threads saw (appended to from several threads; counters under ``lock``)."""

    routes: list[tuple[float, float, str]] = field(default_factory=list)  # (before Route, after it, node)
    node_failures: list[tuple[str, float, float, str, str]] = field(default_factory=list)  # node, t0, t1, code, why
    served: int = 0
    retried: int = 0  # requests served after a failure on another node
    unserved: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # router call failures, unexpected exceptions
    prompts: list[np.ndarray] = field(default_factory=list)
    outages: list[Outage] = field(default_factory=list)
    clears: int = 0
    pushes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def tokens(rng: np.random.Generator, pages: int) -> np.ndarray:
    return rng.integers(0, 50_000, pages * PS).astype(np.uint32)


def serve_prompt(client: HiCacheClient, toks: np.ndarray, rid: str) -> None:
    """One request on a node, as an engine makes it: match, allocate the rest, commit, release."""
    m = client.match(toks, rid)
    new = client.allocate(rid, m.num_pages - m.l1_pages) if m.num_pages > m.l1_pages else m.device_indices[:0]
    client.commit(rid, toks, np.concatenate([m.device_indices, new]))
    client.release(rid)


class Cluster:
    """The node processes (each on a fixed port, so a restart keeps its address) and the router process."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ports = {name: free_port() for name in NODES}
        self.nodes: dict[str, Proc] = {}
        self.router: Proc | None = None
        self.metrics_port = free_port()
        self.channel: grpc.Channel | None = None
        self.stub: rpb_grpc.RouterStub  # set by start()

    def start(self) -> None:
        for name in NODES:
            (self.tmp / f"{name}.yaml").write_text(yaml.safe_dump({
                "layout": LAYOUT,
                "cache": {"l1_tokens": L1_PAGES * PS, "l2_tokens": L2_PAGES * PS, "write_policy": "write_through"},
                "serve": {"port": self.ports[name], "metrics_port": 0, "shared_pool": False,
                          "shutdown_grace_s": 1.0}}))
        errors: list[BaseException] = []

        def start(name: str) -> None:
            try:
                self.start_node(name)
            except BaseException as e:
                errors.append(e)

        starters = [threading.Thread(target=start, args=(name,)) for name in NODES]  # side by side
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        if errors:
            raise errors[0]
        rcfg = self.tmp / "router.yaml"
        rcfg.write_text(yaml.safe_dump({"layout": LAYOUT, "router": ROUTER}))
        nodes = [a for name in NODES for a in ("--node", f"{name}={self.address(name)}")]
        self.router = Proc(["route", "--config", str(rcfg), "--port", "0", "--metrics-port", str(self.metrics_port),
                            *nodes], ROUTE_READY)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.router.port}")
        self.stub = rpb_grpc.RouterStub(self.channel)

    def start_node(self, name: str) -> None:
        self.nodes[name] = Proc(["serve", "--config", str(self.tmp / f"{name}.yaml")], SERVE_READY)

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def list_nodes(self) -> dict[str, Any]:
        return {n.name: n for n in self.stub.ListNodes(rpb.ListNodesRequest(), timeout=5).nodes}

    def wait(self, what: str, pred: Callable[[], bool], timeout_s: float) -> float:
        """Poll ``pred`` until true; returns the time it was."""
        end = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > end:
                raise AssertionError(f"{what}: not within {timeout_s} s; router: {self.list_nodes()}")
            time.sleep(0.02)
        return time.monotonic()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        for p in [self.router, *self.nodes.values()]:
            if p is not None:
                p.stop()


class Client(threading.Thread):
    """An engine: prompts through the router, each served on the node it names."""

    def __init__(self, k: int, cluster: Cluster, docs: list[np.ndarray], log: Log, halt: threading.Event) -> None:
        super().__init__(name=f"client-{k}", daemon=True)
        self.k = k
        self.cluster = cluster
        self.docs = docs
        self.log = log
        self.halt = halt
        self.rng = np.random.default_rng(SEED + 1 + k)
        self.clients: dict[str, HiCacheClient] = {}

    def node(self, name: str) -> HiCacheClient:
        """This engine's client of a node, with a fresh channel after a failure there (a channel that
        failed to connect waits out gRPC's reconnect backoff, which can outlast the node's restart)."""
        c = self.clients.get(name)
        if c is None:
            c = self.clients[name] = HiCacheClient(self.cluster.address(name), timeout_s=5.0)
        return c

    def drop(self, name: str) -> None:
        c = self.clients.pop(name, None)
        if c is not None:
            c.close()

    def run(self) -> None:
        try:
            n = 0
            while not self.halt.is_set():
                if self.rng.random() < 0.75:
                    doc = self.docs[int(self.rng.integers(len(self.docs)))]
                    toks = np.concatenate([doc, tokens(self.rng, TAIL_PAGES)])
                else:
                    toks = tokens(self.rng, DOC_PAGES + TAIL_PAGES)
                self.log.prompts.append(toks)
                self.one(toks, f"c{self.k}-{n}")
                n += 1
        except Exception:
            self.log.errors.append(f"{self.name}: {traceback.format_exc()}")
        finally:
            for name in list(self.clients):
                self.drop(name)

    def one(self, toks: np.ndarray, rid: str) -> None:
        """Route, serve, Complete; after a failure on the node, route again without it."""
        stub = self.cluster.stub
        exclude: list[str] = []
        for attempt in range(len(NODES)):
            t0 = time.monotonic()
            try:
                d = stub.Route(rpb.RouteRequest(tokens=toks.astype("<u4").tobytes(), exclude_nodes=exclude),
                               timeout=5)
            except grpc.RpcError as e:
                self.log.errors.append(f"{rid}: Route failed (exclude {exclude}): {e.code().name}: {e.details()}")
                return
            self.log.routes.append((t0, time.monotonic(), d.node))
            code = grpc.StatusCode.OK
            try:
                serve_prompt(self.node(d.node), toks, f"{rid}-{attempt}")
            except grpc.RpcError as e:
                code = e.code()
                self.log.node_failures.append((d.node, t0, time.monotonic(), code.name, e.details() or ""))
                self.drop(d.node)
            try:
                stub.Complete(rpb.CompleteRequest(route_id=d.route_id, status_code=code.value[0]), timeout=5)
            except grpc.RpcError as e:
                self.log.errors.append(f"{rid}: Complete failed: {e.code().name}: {e.details()}")
            if code == grpc.StatusCode.OK:
                with self.log.lock:
                    self.log.served += 1
                    self.log.retried += attempt > 0
                return
            exclude.append(d.node)
        self.log.unserved.append(rid)


class Churn(threading.Thread):
    """Kills and restarts every node once (n2 for long, n0 and n1 briefly meanwhile); Clears nodes and
    pushes new prompts straight to them between the kills."""

    def __init__(self, cluster: Cluster, log: Log) -> None:
        super().__init__(name="churn", daemon=True)
        self.cluster = cluster
        self.log = log
        self.rng = np.random.default_rng(SEED)

    def run(self) -> None:
        try:
            time.sleep(1.5)  # traffic first: the nodes hold the documents
            long = self.kill("n2")
            for name, other in (("n0", "n1"), ("n1", "n0")):  # at times two of the three nodes are down
                self.restart(self.kill(name), DOWN_S)
                self.clear(other)
                self.push(other)
            self.restart(long, LONG_DOWN_S)
            self.clear("n0")
            self.push("n1")
        except Exception:
            self.log.errors.append(f"churn: {traceback.format_exc()}")

    def kill(self, name: str) -> Outage:
        """SIGKILL the node; returns once the router shows it out of rotation."""
        c = self.cluster
        old = c.nodes[name]
        out = Outage(name, old.server_id, time.monotonic())
        self.log.outages.append(out)
        old.kill()

        def out_of_rotation() -> bool:
            v = c.list_nodes()[name]
            return v.breaker == "open" and not v.connected and v.l1_pages == v.l2_pages == 0

        out.opened = c.wait(f"{name} out of rotation after SIGKILL", out_of_rotation, 10.0)
        return out

    def restart(self, out: Outage, down_s: float) -> None:
        """Restart the node on its address ``down_s`` after its kill; returns once the router is in sync
        with the new run and has routed a request there."""
        c = self.cluster
        time.sleep(max(0.0, out.killed + down_s - time.monotonic()))
        c.start_node(out.node)
        new = c.nodes[out.node]
        out.up = new.up_at
        assert new.server_id and new.server_id != out.old_server, (out, new.server_id)
        routed: list[int] = []

        def back() -> bool:
            v = c.list_nodes()[out.node]
            if not (v.connected and v.server_id == new.server_id and v.breaker == "closed"):
                return False
            routed.append(v.routed)
            return v.routed > routed[0]  # a request routed there since it came back

        out.recovered = c.wait(f"{out.node} back in rotation after its restart", back, 60.0)

    def clear(self, name: str) -> None:
        with HiCacheClient(self.cluster.address(name)) as c:
            c.clear()
        self.log.clears += 1

    def push(self, name: str) -> None:
        """New prompts straight to the node (another engine's traffic): evictions the router must follow."""
        with HiCacheClient(self.cluster.address(name)) as c:
            for j in range(PUSH_PROMPTS):
                serve_prompt(c, tokens(self.rng, PUSH_PAGES), f"push-{self.log.pushes}-{j}")
        self.log.pushes += 1


def check_outages(log: Log) -> None:
    """Check 1 (see the module docstring)."""
    cooldown = float(ROUTER["breaker_cooldown_s"])
    assert sorted(o.node for o in log.outages) == sorted(NODES)
    for out in log.outages:
        assert out.opened - out.killed <= OPEN_WITHIN_S, (
            f"{out.node}: out of rotation {out.opened - out.killed:.2f} s after its kill (bound {OPEN_WITHIN_S})")
        assert out.recovered - out.up <= RECOVER_WITHIN_S, (
            f"{out.node}: routed to again {out.recovered - out.up:.2f} s after its restart, down "
            f"{out.up - out.killed:.1f} s (bound {RECOVER_WITHIN_S})")
        closed_until = min(out.up, out.killed + cooldown)  # no probe of the dead node before then
        bad = [(round(t0 - out.killed, 3), round(t1 - out.killed, 3)) for t0, t1, node in log.routes
               if node == out.node and t0 >= out.killed + OPEN_WITHIN_S and t1 < closed_until]
        assert not bad, f"{out.node} routed to while dead and out of rotation (s after the kill): {bad}"


def check_failures(log: Log) -> None:
    """Check 3: every failed call on a node happened while that node was killed and not yet back."""
    for node, t0, t1, code, details in log.node_failures:
        during = [o for o in log.outages if o.node == node and o.killed <= t1 and t0 <= o.up]
        assert during and code in ("UNAVAILABLE", "NOT_FOUND"), (
            f"a request failed on {node} ({code}: {details}) at {t0:.3f}-{t1:.3f}, outside its outages "
            f"{[(o.killed, o.up) for o in log.outages if o.node == node]}")


def check_index(cluster: Cluster, docs: list[np.ndarray], log: Log) -> tuple[dict[str, Any], int, int]:
    """Check 2, on a quiet cluster; returns ListNodes' views and the prompts compared with an L1 / L2 hit."""
    admins = {name: HiCacheClient(cluster.address(name)) for name in NODES}
    try:
        for c in admins.values():
            c.flush()  # backups to L2 still in flight end (their tier events are emitted now)

        def in_sync() -> bool:
            views = cluster.list_nodes()
            seqs = {name: c.stats().event_sequence for name, c in admins.items()}
            return all(views[n].connected and views[n].server_id == cluster.nodes[n].server_id
                       and views[n].event_sequence == seqs[n] for n in NODES)

        cluster.wait("router in sync with every node", in_sync, 10.0)
        views = cluster.list_nodes()
        for name, c in admins.items():
            s, v = c.stats(), views[name]
            assert s.open_requests == 0 and v.in_flight == 0 and s.event_sequence == v.event_sequence, (name, v, s)
            assert (v.l1_pages, v.l2_pages) == (s.l1_pages_cached, s.l2_pages_cached), (name, v, s)
        sample = docs + log.prompts[::max(1, len(log.prompts) // 300)]
        hits = l2_hits = 0
        mismatches = []
        for toks in sample:
            d = cluster.stub.Route(rpb.RouteRequest(tokens=toks.astype("<u4").tobytes(), peek=True), timeout=5)
            assert [s.node for s in d.scores] == list(NODES)
            for s in d.scores:
                m = admins[s.node].match(toks, peek=True, skip_l3=True)
                if (s.l1_pages, s.l2_pages) != (m.l1_pages, m.l2_pages):
                    mismatches.append((s.node, "router", (s.l1_pages, s.l2_pages), "node", (m.l1_pages, m.l2_pages)))
                hits += m.l1_pages > 0
                l2_hits += m.l2_pages > 0
        assert not mismatches, f"index != node for {len(mismatches)} of {len(sample) * len(NODES)}: {mismatches[:10]}"
        return views, hits, l2_hits
    finally:
        for c in admins.values():
            c.close()


@pytest.mark.slow
def test_router_index_under_churn(tmp_path: Path) -> None:
    t_start = time.monotonic()
    cluster = Cluster(tmp_path)
    try:
        cluster.start()
        cluster.wait("every node in sync", lambda: all(v.connected for v in cluster.list_nodes().values()), 20.0)
        doc_rng = np.random.default_rng(SEED - 1)
        docs = [tokens(doc_rng, DOC_PAGES) for _ in range(DOCS)]
        log = Log()
        halt = threading.Event()
        clients = [Client(k, cluster, docs, log, halt) for k in range(CLIENTS)]
        churn = Churn(cluster, log)
        for t in [*clients, churn]:
            t.start()
        churn.join(120)
        time.sleep(1.0)  # a last stretch of traffic over the restarted cluster
        halt.set()
        for t in clients:
            t.join(30)
        assert not churn.is_alive() and not any(t.is_alive() for t in clients), "a thread is stuck"
        assert not log.errors, "\n".join(log.errors)
        check_outages(log)
        check_failures(log)
        assert not log.unserved, f"requests never served: {log.unserved}"
        assert log.clears == log.pushes == 3
        views, hits, l2_hits = check_index(cluster, docs, log)

        # not vacuous: traffic on every node, retries after a kill, resyncs, prefixes on both tiers compared
        per_node = {n: sum(1 for _, _, node in log.routes if node == n) for n in NODES}
        assert log.served >= 300 and all(v >= 30 for v in per_node.values()), (log.served, per_node)
        assert log.retried >= 1 and log.node_failures, "no request hit a killed node"
        assert sum(v.routed for v in views.values()) == len(log.routes)
        assert all(v.resyncs >= 1 for v in views.values()), views  # each restart: a new run's snapshot
        # and at least one more: a node dropped the router's overflowing queue and re-snapshotted the stream
        assert sum(v.resyncs for v in views.values()) > len(log.outages), views
        assert hits >= 20 and l2_hits >= 1, (hits, l2_hits)
        text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=5).read().decode()
        for name in NODES:
            m = re.search(rf'^hicache_router_resyncs_total{{node="{name}"}} (\S+)$', text, re.M)
            assert m and float(m.group(1)) == views[name].resyncs, (name, m)

        # 4: the router logged the killed nodes' connection failures as WARNINGs, and nothing as an error
        assert cluster.router is not None
        router_log = cluster.router.log()
        bad = [ln for ln in router_log.splitlines() if re.search(r"\b(ERROR|CRITICAL)\b|Traceback|^E\d{4} ", ln)]
        assert not bad, "\n".join(bad)
        for name in NODES:
            assert f"WARNING hicache.router: node {name}: event stream: UNAVAILABLE" in router_log
        print(f"\nchurn soak: {log.served} served, {log.retried} after a failure on a killed node "
              f"({len(log.node_failures)} failures); routed {per_node}; resyncs "
              f"{ {n: v.resyncs for n, v in views.items()} }; compared {hits} L1 / {l2_hits} L2 prefixes; "
              + "; ".join(f"{o.node} out {o.opened - o.killed:.2f} s after kill, back {o.recovered - o.up:.2f} s "
                          f"after restart (down {o.up - o.killed:.1f} s)" for o in log.outages)
              + f"; {time.monotonic() - t_start:.1f} s")
    finally:
        cluster.close()
