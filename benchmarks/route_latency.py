"""The router's Route RPC under load: requests/s, p50 and p99 against a trivial RPC on the same server, and
the index's memory per million pages.

Setup (issue #40's shape): 8 node services (``NodeServer``, what ``hicache serve`` runs; CPU pool, a tiny
layout, page size 64) in one process, each holding realistic trees: ``--docs`` documents / system prompts
of ``--prefix-tokens`` tokens, each cached with ``--suffixes`` distinct suffixes up to 8,192 tokens on its
home node (every ``--replica-every``-th document also on the next node, with half its suffixes). The
caches are filled in process, as an engine fills them; the router, a real ``hicache route`` subprocess,
learns them the production way: ``GetPoolInfo``, each node's ``WatchEvents`` snapshot (keys verified
from the tokens) and ``Stats`` polls. Clients (asyncio tasks over one ``AsyncRouterClient`` channel per
client process) send 8,192-token requests drawn from a pool: ``--mix`` shares of a cached prompt again
(128 pages held), a new question on a cached document (its prefix held) and an unknown document (no
prefix). Each request is ``Route`` (named, as the client library does; latency is this call's) followed
by ``Complete``, so every route's load starts and ends as in production; the Route does its real work:
128 page keys, the index walk over the 8 nodes, scoring against in-flight load and queue depths.

Closed loop (each client sends when its last request finished) gives the saturation rate; open loop at
``--rate`` (paced sends, latency from the scheduled send time) gives the latency at that load. The
in-run baseline is the same clients sending two ``grpc.health.v1.Health/Check`` calls (empty request,
same router process) per request in place of Route + Complete: the ratio is what routing costs beyond
gRPC itself. The same decisions in this process (``Router.route`` + ``complete`` on the same index, no
gRPC) are timed too. Index memory: tracemalloc around applying the same snapshots to an in-process
``Router`` (keys, per-key holder dicts and per-node page maps), per page held by a node and per distinct
key, scaled to 1M pages. Router, nodes and clients share the machine's cores: "clients included".

    python benchmarks/route_latency.py [--clients 64] [--client-procs 4] [--seconds 5] [--rate 3000]
                                       [--docs 256] [--suffixes 16] [--json out/route_latency.json]
    python benchmarks/route_latency.py --quick     # a few-second smoke run (small trees, 1 s phases)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import multiprocessing as mp
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from grpc_latency import paced, pct, proc_cpu_s  # noqa: E402

PAGE = 64
# a tiny layout: the router never sees KV bytes, and 8 nodes' pools must fit a small host
LAYOUT = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float16", "page_size": PAGE}
VOCAB = 128_000


@dataclass(frozen=True)
class Shape:
    nodes: int = 8
    tokens: int = 8192  # per request
    prefix_tokens: int = 6144  # the document / system prompt every suffix of it shares
    docs: int = 256
    suffixes: int = 16  # cached per document on its home node
    replica_every: int = 4  # every n-th document is cached on a second node too (half its suffixes)

    def doc(self, d: int) -> np.ndarray:
        return np.random.default_rng([1, d]).integers(0, VOCAB, self.prefix_tokens).astype(np.uint32)

    def suffix(self, d: int, s: int) -> np.ndarray:
        return np.random.default_rng([2, d, s]).integers(0, VOCAB, self.tokens - self.prefix_tokens
                                                         ).astype(np.uint32)

    def placement(self, d: int) -> list[tuple[int, list[int]]]:
        """(node, cached suffixes) for document ``d``."""
        out = [(d % self.nodes, list(range(self.suffixes)))]
        if self.replica_every and d % self.replica_every == 0 and self.nodes > 1:
            out.append(((d + 1) % self.nodes, list(range(0, self.suffixes, 2))))
        return out

    def node_prompts(self, node: int) -> list[tuple[int, int]]:
        return [(d, s) for d in range(self.docs) for n, ss in self.placement(d) if n == node for s in ss]

    def node_pages(self, node: int) -> int:
        docs = {d for d, _ in self.node_prompts(node)}
        return (len(docs) * self.prefix_tokens + len(self.node_prompts(node)) * (self.tokens - self.prefix_tokens)
                ) // PAGE


def request_pool(shape: Shape, n: int, mix: tuple[float, float, float], seed: int = 7) -> tuple[list[bytes], list[str]]:
    """``n`` requests (uint32 LE bytes): a cached prompt again, a new question on a cached document, or an
    unknown document, in the shares of ``mix``; and each one's kind."""
    rng = np.random.default_rng(seed)
    p = np.asarray(mix, dtype=float) / sum(mix)
    out, kinds = [], []
    for i in range(n):
        kind = ("repeat", "new_suffix", "miss")[int(rng.choice(3, p=p))]
        d = int(rng.integers(shape.docs))
        if kind == "repeat":
            toks = np.concatenate([shape.doc(d), shape.suffix(d, int(rng.integers(shape.suffixes)))])
        elif kind == "new_suffix":
            toks = np.concatenate([shape.doc(d), shape.suffix(d, 1_000_000 + i)])
        else:
            toks = np.random.default_rng([3, i]).integers(0, VOCAB, shape.tokens).astype(np.uint32)
        out.append(toks.astype("<u4").tobytes())
        kinds.append(kind)
    return out, kinds


def node_config(shape: Shape, node: int) -> dict[str, Any]:
    return {"layout": LAYOUT,
            "cache": {"l1_tokens": max(65536, int(shape.node_pages(node) * PAGE * 1.25)), "l2_tokens": 0},
            "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0,
                      "max_concurrency": 1024}}


# ---------------------------------------------------------------------- nodes (one process, 8 servers)
def fill_cache(cache: Any, shape: Shape, node: int) -> None:
    """Run the node's prompts as an engine would: match, allocate the new pages, commit, release."""
    for d, s in shape.node_prompts(node):
        toks = np.concatenate([shape.doc(d), shape.suffix(d, s)])
        req = cache.match(toks, l3=False, keys=False)
        new = cache.alloc(req, len(toks) // PAGE - req.l1_pages)
        cache.commit(req, toks, np.concatenate([req.device_indices, new]))
        cache.release(req)


def _nodes_proc(shape: Shape, out: Any, stop: Any) -> None:
    import uvloop

    from hicache.config import config_from_dict
    from hicache.service.server import NodeServer

    async def main() -> None:
        servers = []
        for i in range(shape.nodes):
            srv = NodeServer(config_from_dict(node_config(shape, i)))
            await srv.start()
            assert srv.cache is not None
            fill_cache(srv.cache, shape, i)
            servers.append(srv)
        out.put([s.port for s in servers])
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for s in servers:
            await s.stop(0.5)

    uvloop.run(main())


# ---------------------------------------------------------------------- router (`hicache route` subprocess)
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_router(ports: list[int], tmp: Path) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    path = tmp / "route.yaml"
    path.write_text(yaml.safe_dump({"layout": LAYOUT}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "hicache.cli", "route", "--config", str(path), "--port", str(port),
           "--metrics-port", "0", "--log-level", "WARNING"]
    for i, p in enumerate(ports):
        cmd += ["--node", f"n{i}=127.0.0.1:{p}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"router did not start: {line!r}")
    return proc, f"127.0.0.1:{port}"


def wait_indexed(target: str, pages: int, timeout_s: float = 300.0) -> list[Any]:
    """Until every node is in sync and the router indexes ``pages`` node pages; returns ListNodes' nodes."""
    from hicache.router.client import RouterClient

    end = time.monotonic() + timeout_s
    with RouterClient(target, timeout_s=30) as rc:
        while True:
            nodes = list(rc.list_nodes().nodes)
            if all(n.connected for n in nodes) and sum(n.l1_pages + n.l2_pages for n in nodes) == pages:
                return nodes
            if time.monotonic() > end:
                raise TimeoutError(f"router not in sync: {[(n.name, n.connected, n.l1_pages) for n in nodes]}")
            time.sleep(0.05)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------- clients
def _client_proc(target: str, payloads: list[bytes], phases: list[tuple[str, float, float]], clients: int,
                 barrier: Any, out: Any) -> None:
    """``clients`` asyncio clients on one channel, running ``phases`` (kind, rate, seconds) one after the
    other, each begun at ``barrier`` with the other client processes. kind ``route``: Route (named) then
    Complete per request; ``health``: two Health/Check calls. ``rate`` 0: closed loop; else this process's
    share of the open-loop rate, each client paced at rate/clients, latency from the scheduled send."""
    import uvloop
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hicache.router.client import AsyncRouterClient

    gc.collect()
    gc.freeze()  # keep full collections short: they show up as tail latency

    async def main() -> None:
        async with AsyncRouterClient(target, timeout_s=60) as rc:
            hstub = health_pb2_grpc.HealthStub(rc.channel)
            hreq = health_pb2.HealthCheckRequest(service="")
            d = await rc.route(payloads[0])  # connect + warm
            await rc.complete(d.route_id)
            await hstub.Check(hreq, timeout=30)
            for phase, (kind, rate, seconds) in enumerate(phases):
                await asyncio.to_thread(barrier.wait, 300)
                out.put((phase, await run_phase(rc, hstub, hreq, kind, rate, seconds)))

    async def run_phase(rc: Any, hstub: Any, hreq: Any, kind: str, rate: float, seconds: float) -> dict[str, Any]:
        lat: list[float] = []
        errors = 0
        last_done = 0.0
        reasons: collections.Counter[str] = collections.Counter()
        prefix_pages = num_pages = 0
        pc = time.perf_counter
        cpu0 = time.process_time()
        t_start = pc()
        end = t_start + seconds

        async def one(p: bytes) -> float:
            nonlocal prefix_pages, num_pages
            if kind == "route":
                d = await rc.route(p)
                done = pc()
                await rc.complete(d.route_id)
                reasons[d.reason] += 1
                prefix_pages += d.l1_pages + d.l2_pages
                num_pages += d.num_pages
            else:
                await hstub.Check(hreq, timeout=60)
                done = pc()
                await hstub.Check(hreq, timeout=60)
            return done

        async def worker(i: int) -> None:
            nonlocal errors, last_done
            k = i * 7919  # each client walks the pool from its own place

            async def send() -> float:
                nonlocal k
                k += 1
                return await one(payloads[k % len(payloads)])

            e, done = await paced(send, i, clients, rate, t_start, end, lat)
            errors += e
            last_done = max(last_done, done)

        await asyncio.gather(*(worker(i) for i in range(clients)))
        return {"lat": lat, "errors": errors, "elapsed": max(seconds, last_done),
                "cpu": time.process_time() - cpu0, "reasons": dict(reasons), "prefix_pages": prefix_pages,
                "num_pages": num_pages}

    uvloop.run(main())


def run_phases(target: str, payloads: list[bytes], phases: list[tuple[str, float, float]], clients: int,
               procs: int, server_pid: int) -> list[dict[str, Any]]:
    """``phases`` one after the other in the same client processes; per phase the merged figures."""
    procs = max(1, min(procs, clients))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(procs + 1)  # the client processes and this one: each phase starts at once
    per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    ps = [ctx.Process(target=_client_proc, args=(
        target, payloads, [(k, rate * n / clients, s) for k, rate, s in phases], n, barrier, q)) for n in per]
    for p in ps:
        p.start()
    results = []
    try:
        for i, (kind, rate, seconds) in enumerate(phases):
            barrier.wait(300)
            srv0 = proc_cpu_s(server_pid)
            parts = [q.get(timeout=seconds + 300) for _ in ps]
            srv_cpu = proc_cpu_s(server_pid) - srv0
            assert all(ph == i for ph, _ in parts), parts
            lat = [x for _, r in parts for x in r["lat"]]
            elapsed = max(r["elapsed"] for _, r in parts)
            reasons: collections.Counter[str] = collections.Counter()
            for _, r in parts:
                reasons.update(r["reasons"])
            n = max(len(lat), 1)
            rec: dict[str, Any] = {
                "kind": kind, "loop": "open" if rate else "closed", "clients": clients, "client_procs": procs,
                "offered_per_s": rate or None, "requests": len(lat), "errors": sum(r["errors"] for _, r in parts),
                "req_per_s": len(lat) / elapsed, "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
                "server_cpu_us_per_req": srv_cpu / n * 1e6,
                "client_cpu_us_per_req": sum(r["cpu"] for _, r in parts) / n * 1e6}
            if kind == "route":
                rec["reasons"] = dict(reasons)
                rec["prefix_share"] = sum(r["prefix_pages"] for _, r in parts) / max(
                    1, sum(r["num_pages"] for _, r in parts))
            results.append(rec)
    finally:
        for p in ps:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results


# ---------------------------------------------------------------------- in process: index memory, decisions
def in_process_router(shape: Shape, names: list[str]) -> Any:
    from hicache.config import config_from_dict
    from hicache.router.config import NodeSpec, RouterConfig
    from hicache.router.core import Router

    rc = RouterConfig(nodes=[NodeSpec(n, f"127.0.0.1:{50000 + i}") for i, n in enumerate(names)])
    r = Router(config_from_dict({"layout": LAYOUT}), rc)
    for n in names:
        r.set_namespace_digest(n, r.ns.digest)
    return r


def snapshots(shape: Shape, router: Any) -> list[tuple[str, Any]]:
    """Each node's snapshot as its WatchEvents stream carries it: a run per radix node (document prefix,
    then each suffix continuing it)."""
    from hicache.client.types import Event, PageRun
    from hicache.keys import page_keys

    ns = router.ns
    pre = shape.prefix_tokens // PAGE
    out = []
    for node in range(shape.nodes):
        runs = []
        by_doc: dict[int, list[int]] = collections.defaultdict(list)
        for d, s in shape.node_prompts(node):
            by_doc[d].append(s)
        for d, ss in by_doc.items():
            doc = shape.doc(d)
            dk = page_keys(ns, doc)
            runs.append(PageRun(ns.digest, b"", dk, doc, ("l1",)))
            for s in ss:
                toks = np.concatenate([doc, shape.suffix(d, s)])
                keys = page_keys(ns, toks)
                runs.append(PageRun(ns.digest, keys[pre - 1], keys[pre:], toks[pre * PAGE:], ("l1",)))
        out.append((f"n{node}", Event(1, "snapshot", runs, f"srv{node}", False)))
    return out


def index_memory(shape: Shape) -> tuple[dict[str, Any], Any]:
    """tracemalloc of the index filled with the nodes' snapshots through ``Router.apply_event`` (the feed's
    call); returns the figures and the filled router."""
    from hicache.router.index import Applied

    names = [f"n{i}" for i in range(shape.nodes)]
    router = in_process_router(shape, names)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    events = snapshots(shape, router)
    for name, ev in events:
        assert router.apply_event(name, ev) is Applied.APPLIED
    del events, ev
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    pages = sum(len(router.index.feed(n).pages) for n in names)
    keys = len(router.index)
    return {"node_pages": pages, "distinct_keys": keys, "bytes": used, "bytes_per_page": used / pages,
            "bytes_per_key": used / keys, "bytes_per_1m_pages": used / pages * 1e6,
            "bytes_per_1m_keys": used / keys * 1e6}, router


def in_process_routes(router: Any, payloads: list[bytes], seconds: float) -> dict[str, float]:
    """Router.route + complete over the pool in this process (what the servicer calls, no gRPC)."""
    lat: list[float] = []
    pc = time.perf_counter
    end = pc() + seconds
    cpu0 = time.process_time()
    i = 0
    while pc() < end:
        p = payloads[i % len(payloads)]
        i += 1
        t0 = pc()
        d = router.route(p, request_id=f"r{i}")
        router.complete(d.route_id)
        lat.append(pc() - t0)
    cpu = time.process_time() - cpu0
    return {"requests": len(lat), "req_per_s": len(lat) / seconds, "cpu_us_per_req": cpu / len(lat) * 1e6,
            "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=4, help="client processes sharing the clients")
    ap.add_argument("--seconds", type=float, default=5.0, help="per phase")
    ap.add_argument("--rate", type=float, default=None, help="open-loop offered rate, req/s (0: skip; default "
                    "3000, --quick 1000)")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--docs", type=int, default=256, help="documents / system prompts cached on the nodes")
    ap.add_argument("--suffixes", type=int, default=16, help="cached suffixes per document on its home node")
    ap.add_argument("--prefix-tokens", type=int, default=6144)
    ap.add_argument("--tokens", type=int, default=8192, help="per request")
    ap.add_argument("--mix", type=float, nargs=3, default=[0.3, 0.5, 0.2], metavar=("REPEAT", "NEW", "MISS"),
                    help="shares of requests: a cached prompt again, a new question on a cached document, "
                    "an unknown document")
    ap.add_argument("--pool", type=int, default=512, help="distinct requests the clients cycle through")
    ap.add_argument("--quick", action="store_true", help="a few-second smoke run: small trees, 1 s phases")
    ap.add_argument("--json", default="out/route_latency.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.docs, args.suffixes, args.pool = min(args.docs, 24), min(args.suffixes, 4), min(args.pool, 48)
        args.seconds, args.client_procs = min(args.seconds, 1.0), 1
    rate = (1000.0 if args.quick else 3000.0) if args.rate is None else args.rate
    shape = Shape(args.nodes, args.tokens, args.prefix_tokens, args.docs, args.suffixes)
    assert args.tokens % PAGE == 0 and args.prefix_tokens % PAGE == 0 and args.prefix_tokens < args.tokens
    load_before = os.getloadavg()

    payloads, kinds = request_pool(shape, args.pool, tuple(args.mix))
    mem, router = index_memory(shape)
    print(f"index: {mem['node_pages']:,} node pages ({mem['distinct_keys']:,} distinct keys) on {shape.nodes} "
          f"nodes: {mem['bytes'] / 2**20:.1f} MiB, {mem['bytes_per_page']:.0f} B/page "
          f"({mem['bytes_per_1m_pages'] / 2**20:.0f} MiB per 1M pages), {mem['bytes_per_key']:.0f} B/key")
    inproc = in_process_routes(router, payloads, 0.3 if args.quick else min(args.seconds, 3.0))
    del router
    gc.collect()
    print(f"in-process  Router.route+complete: {inproc['req_per_s']:8.0f} req/s  p50 {inproc['p50_ms']:.3f} ms  "
          f"p99 {inproc['p99_ms']:.3f} ms  CPU/req {inproc['cpu_us_per_req']:.0f} us")

    ctx = mp.get_context("spawn")
    ports_q, stop = ctx.Queue(), ctx.Event()
    t0 = time.perf_counter()
    nodes_proc = ctx.Process(target=_nodes_proc, args=(shape, ports_q, stop))
    nodes_proc.start()
    levels: list[dict[str, Any]] = []
    try:
        ports = ports_q.get(timeout=600)
        fill_s = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            proc, target = start_router(ports, Path(tmp))
            try:
                listed = wait_indexed(target, mem["node_pages"])
                sync_s = time.perf_counter() - t0
                router_rss = rss_bytes(proc.pid)
                print(f"nodes filled in {fill_s:.1f} s; router in sync in {sync_s:.1f} s "
                      f"({sum(n.l1_pages for n in listed):,} pages; router RSS {router_rss / 2**20:.0f} MiB)")
                phases = [("health", 0.0, args.seconds), ("route", 0.0, args.seconds)]
                if rate:
                    phases += [("health", rate, args.seconds), ("route", rate, args.seconds)]
                levels = run_phases(target, payloads, phases, args.clients, args.client_procs, proc.pid)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    finally:
        stop.set()
        nodes_proc.join(30)
        if nodes_proc.is_alive():
            nodes_proc.kill()

    base = {(r["kind"], r["loop"]): r for r in levels if r["kind"] == "health"}
    for r in levels:
        loop = f"open loop {r['offered_per_s']:.0f}/s" if r["offered_per_s"] else "closed loop"
        what = "Route+Complete" if r["kind"] == "route" else "2x Health/Check"
        extra = ""
        if r["kind"] == "route":
            b = base.get(("health", r["loop"]))
            if b is not None:
                r["vs_health_rate"] = r["req_per_s"] / b["req_per_s"]
                r["vs_health_p50"] = r["p50_ms"] / b["p50_ms"]
                r["vs_health_p99"] = r["p99_ms"] / b["p99_ms"]
                extra = (f"  ({r['vs_health_rate']:.2f}x health's rate, p50 {r['vs_health_p50']:.2f}x, "
                         f"p99 {r['vs_health_p99']:.2f}x; prefix {r['prefix_share']:.0%} of pages, "
                         f"{r['reasons']})")
        print(f"{what:15s} {r['clients']:3d} clients, {loop:19s}: {r['req_per_s']:8.0f} req/s  "
              f"p50 {r['p50_ms']:8.3f} ms  p99 {r['p99_ms']:8.3f} ms  CPU/req server "
              f"{r['server_cpu_us_per_req']:.0f} us client {r['client_cpu_us_per_req']:.0f} us; "
              f"{r['errors']} errors{extra}")
    result = {
        "benchmark": "route_latency", "shape": asdict(shape), "page_size": PAGE, "layout": LAYOUT,
        "mix": dict(zip(("repeat", "new_suffix", "miss"), args.mix, strict=True)),
        "pool": args.pool, "pool_kinds": dict(collections.Counter(kinds)), "seconds": args.seconds,
        "quick": args.quick, "cpus": os.cpu_count(),
        "note": f"{os.cpu_count()}-core host: router, 8 nodes (one process) and {args.client_procs} client "
                "process(es) share its cores",
        "python": platform.python_version(), "machine": platform.machine(), "load_avg_before": load_before,
        "nodes_fill_s": fill_s, "router_sync_s": sync_s, "router_rss_bytes": router_rss,
        "index_memory": mem, "in_process": inproc, "grpc": levels,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
