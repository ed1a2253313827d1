"""Cache-aware routing vs round robin on a multi-tenant RAG workload: cluster hit rate and load balance.

N simulated nodes are in-process HiCache instances (tiny KV layout, CPU; real radix trees, L1 and L2
capacities, eviction). Each node's tree events go through the same path as a live node's WatchEvents
stream (``hicache.service.events.page_run`` -> protobuf Event -> ``Router.apply_event``) into one
:class:`hicache.router.Router`, which picks the node for every request; the node then serves it (match,
load L2 -> L1, compute the rest, commit) and the hit is what the node itself matched.

Workload: ``--tenants`` tenants (each its own key namespace), each with a system prompt and
``--topics`` document sets; a request is tenant + system prompt + one document set (Zipf-popular, so a
few sets are hot) + a fresh question. Arrivals are Poisson at ``--rate`` requests/s; each node serves
one request at a time, FIFO, for ``uncached tokens / --prefill-tps + L2 tokens / --load-tps``; a
request's completion is reported to the router (Complete) at its finish time, so the router sees the load
its choices create. TTFT = queueing + service in simulated time.

round_robin is the in-run baseline (ratio column); least_load shows what balance alone gives. Figures:
hit rate (tokens served from L1/L2 over prompt tokens), requests per node max/mean, simulated TTFT, and
how often the router's predicted prefix equalled the node's actual match.

    python benchmarks/router_hit_rate.py [--nodes 4] [--requests 3000] [--json out/router_hit_rate.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from hicache.cache import HiCache
from hicache.client.types import Event
from hicache.config import CacheConfig, HiCacheConfig, config_from_dict
from hicache.keys import Namespace
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.radix_types import TreeEvent
from hicache.router import Router
from hicache.router.config import NodeSpec, RouterConfig
from hicache.router.index import Applied
from hicache.service.events import page_run

_KINDS = {"stored": pb.Event.STORED, "removed": pb.Event.REMOVED, "tier": pb.Event.TIER_CHANGED}


class SimNode:
    """A HiCache whose tree events are numbered and converted exactly as the node service does."""

    def __init__(self, name: str, config: HiCacheConfig, router: Router, events: bool = True) -> None:
        self.name = name
        self.cache = HiCache(config)
        self.router = router
        self.seq = 0
        self.pending: list[pb.Event] = []
        if not events:  # the approximate index: the router learns from its own routes only
            return
        self.cache.add_listener(self._on_event)
        box = [0]
        runs = self.cache.snapshot(lambda: box.__setitem__(0, self.seq))
        snap = pb.Event(sequence=box[0], kind=pb.Event.SNAPSHOT, runs=[page_run(r) for r in runs], server_id=name)
        router.apply_event(name, Event.from_pb(snap))

    def _on_event(self, ev: TreeEvent) -> None:
        self.seq += 1
        self.pending.append(pb.Event(sequence=self.seq, kind=_KINDS[ev.kind], runs=[page_run(ev)],
                                     server_id=self.name))

    def publish(self) -> None:
        for m in self.pending:
            # through the wire format, as a router reading WatchEvents gets it
            res = self.router.apply_event(self.name, Event.from_pb(pb.Event.FromString(m.SerializeToString())))
            assert res is Applied.APPLIED, res
        self.pending.clear()

    def serve(self, toks: np.ndarray, ns: Namespace) -> tuple[int, int]:
        """One request: returns the (L1, L2) pages the node matched."""
        c = self.cache
        req = c.match(toks, ns, l3=False)
        hit = (req.l1_pages, req.l2_pages)
        load = c.load_back(req)
        load.wait()
        new = c.alloc(req, len(toks) // c.page_size - len(load.device_indices))
        c.commit(req, toks, np.concatenate([load.device_indices, new]))
        c.release(req)
        self.publish()
        return hit


def workload(a: argparse.Namespace) -> list[tuple[float, str, np.ndarray]]:
    """(arrival time s, tenant, tokens) per request."""
    rng = np.random.default_rng(a.seed)
    vocab = 120_000
    tenants = [f"tenant{i}" for i in range(a.tenants)]
    system = {t: rng.integers(0, vocab, a.system_tokens, dtype=np.uint32) for t in tenants}
    docs = {t: [rng.integers(0, vocab, a.doc_tokens, dtype=np.uint32) for _ in range(a.topics)] for t in tenants}
    zipf = 1.0 / np.arange(1, a.topics + 1) ** a.zipf
    zipf /= zipf.sum()
    t = 0.0
    out = []
    for _ in range(a.requests):
        t += float(rng.exponential(1.0 / a.rate))
        tenant = tenants[int(rng.integers(0, a.tenants))]
        topic = int(rng.choice(a.topics, p=zipf))
        q = rng.integers(0, vocab, a.question_tokens, dtype=np.uint32)
        out.append((t, tenant, np.concatenate([system[tenant], docs[tenant][topic], q])))
    return out


def simulate(row: str, reqs: list[tuple[float, str, np.ndarray]], a: argparse.Namespace) -> dict[str, Any]:
    cfg = config_from_dict({
        "model": {"name": "bench-router"},
        "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "dtype": "float16", "page_size": a.page_size},
        "cache": {"l1_tokens": a.l1_tokens, "l2_tokens": a.l2_tokens, "write_policy": a.write_policy},
    })
    names = [f"node{i}" for i in range(a.nodes)]
    policy, _, index = row.partition("@")
    rc = RouterConfig(nodes=[NodeSpec(n, f"sim:{i + 1}") for i, n in enumerate(names)], policy=policy,
                      route_ttl_s=1e9, load_weight=a.load_weight, balance_abs_threshold=a.balance_abs,
                      min_prefix_score=a.min_prefix_score, index=index or "events", approx_ttl_s=a.approx_ttl_s,
                      approx_capacity_tokens=a.approx_capacity_tokens or a.l1_tokens + a.l2_tokens)
    router = Router(cfg, rc)
    clock = [0.0]
    if router.approx is not None:
        router.approx.clock = lambda: clock[0]  # simulated time
    nodes = {n: SimNode(n, cfg, router, events=router.approx is None) for n in names}
    busy = dict.fromkeys(names, 0.0)
    finishing: list[tuple[float, str]] = []
    per_node = dict.fromkeys(names, 0)
    reasons: dict[str, int] = {}
    prompt = hit1 = hit2 = exact = exact_pages = 0
    ttft: list[float] = []
    t_route = 0.0
    t0 = time.perf_counter()
    for now, tenant, toks in reqs:
        clock[0] = now
        while finishing and finishing[0][0] <= now:
            router.complete(heapq.heappop(finishing)[1])
        ts = time.perf_counter()
        d = router.route(toks.tobytes(), tenant=tenant)
        t_route += time.perf_counter() - ts
        l1, l2 = nodes[d.node].serve(toks, router.namespace(tenant))
        exact += (l1, l2) == (d.l1_pages, d.l2_pages)
        exact_pages += l1 + l2 == d.l1_pages + d.l2_pages
        ps = a.page_size
        computed = len(toks) - (l1 + l2) * ps
        service = a.overhead_s + computed / a.prefill_tps + l2 * ps / a.load_tps
        start = max(now, busy[d.node])
        busy[d.node] = start + service
        heapq.heappush(finishing, (start + service, d.route_id))
        ttft.append(start + service - now)
        per_node[d.node] += 1
        reasons[d.reason] = reasons.get(d.reason, 0) + 1
        prompt += len(toks) // ps * ps
        hit1 += l1 * ps
        hit2 += l2 * ps
    wall = time.perf_counter() - t0
    for n in nodes.values():
        n.cache.close()
    counts = list(per_node.values())
    ttft.sort()
    return {
        "policy": policy,
        "index": rc.index,
        "hit_rate": (hit1 + hit2) / prompt,
        "hit_rate_l1": hit1 / prompt,
        "hit_rate_l2": hit2 / prompt,
        "requests_per_node": per_node,
        "reasons": reasons,
        "balance_max_over_mean": max(counts) / statistics.mean(counts),
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))],
        "prediction_exact": exact / len(reqs),  # the predicted (L1, L2) prefix is what the node matched
        "prediction_exact_pages": exact_pages / len(reqs),  # the predicted prefix length, tiers aside
        "route_us": t_route / len(reqs) * 1e6,
        "index_keys": len(router.index),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--topics", type=int, default=24, help="document sets per tenant")
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--zipf", type=float, default=1.0, help="document-set popularity skew")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=100.0, help="arrivals per second (Poisson)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--l1-tokens", type=int, default=16384, help="per node")
    ap.add_argument("--l2-tokens", type=int, default=32768, help="per node")
    ap.add_argument("--write-policy", default=CacheConfig.write_policy,
                    help=f"L1 -> L2 backups (default: {CacheConfig.write_policy})")
    ap.add_argument("--prefill-tps", type=float, default=40_000.0, help="tokens/s a node computes (8B, eager)")
    ap.add_argument("--load-tps", type=float, default=420_000.0, help="tokens/s restored from L2")
    ap.add_argument("--overhead-s", type=float, default=0.002, help="per request")
    ap.add_argument("--load-weight", type=float, default=0.1)
    ap.add_argument("--balance-abs", type=float, default=8.0)
    ap.add_argument("--min-prefix-score", type=float, default=0.2)
    ap.add_argument("--policies", default="round_robin,least_load,cache_aware,cache_aware@approximate",
                    help="rows: POLICY[@INDEX], INDEX events (default) or approximate")
    ap.add_argument("--approx-ttl-s", type=float, default=120.0, help="approximate index: TTL (simulated s)")
    ap.add_argument("--approx-capacity-tokens", type=int, default=0,
                    help="approximate index: tokens predicted per node (0: the node's L1 + L2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="out/router_hit_rate.json")
    a = ap.parse_args()
    reqs = workload(a)
    working_set = a.tenants * (a.system_tokens + a.topics * a.doc_tokens)
    print(f"{a.nodes} nodes x (L1 {a.l1_tokens} + L2 {a.l2_tokens} tokens); {a.tenants} tenants x {a.topics} "
          f"document sets of {a.doc_tokens} tokens (working set {working_set} tokens, zipf {a.zipf}); "
          f"{a.requests} requests at {a.rate:.0f}/s; page {a.page_size}")
    results = {p: simulate(p, reqs, a) for p in a.policies.split(",")}
    base = results.get("round_robin")
    print(f"{'policy':<24} {'hit':>6} {'L1':>6} {'L2':>6} {'vs rr':>6} {'max/mean':>8} {'TTFT mean':>10} "
          f"{'p99':>8} {'exact':>6} {'route':>8}")
    for p, r in results.items():
        ratio = r["hit_rate"] / base["hit_rate"] if base and base["hit_rate"] else float("nan")
        r["hit_rate_vs_round_robin"] = ratio
        if base:
            r["ttft_mean_vs_round_robin"] = r["ttft_mean_s"] / base["ttft_mean_s"]
        print(f"{p:<24} {r['hit_rate']:>6.1%} {r['hit_rate_l1']:>6.1%} {r['hit_rate_l2']:>6.1%} {ratio:>5.2f}x "
              f"{r['balance_max_over_mean']:>8.2f} {r['ttft_mean_s'] * 1e3:>8.1f}ms {r['ttft_p99_s'] * 1e3:>6.0f}ms "
              f"{r['prediction_exact']:>6.1%} {r['route_us']:>6.0f}us")
    if base and "cache_aware" in results:
        ca = results["cache_aware"]
        print(f"cache_aware vs round_robin: hit rate {ca['hit_rate']:.1%} vs {base['hit_rate']:.1%} "
              f"({ca['hit_rate_vs_round_robin']:.2f}x), mean TTFT {ca['ttft_mean_vs_round_robin']:.2f}x, "
              f"load max/mean {ca['balance_max_over_mean']:.2f} vs {base['balance_max_over_mean']:.2f}")
    if base and "cache_aware@approximate" in results and "cache_aware" in results:
        ax, ca = results["cache_aware@approximate"], results["cache_aware"]
        print(f"approximate index (no event streams) vs the event-fed index: hit rate {ax['hit_rate']:.1%} vs "
              f"{ca['hit_rate']:.1%} ({ax['hit_rate'] / ca['hit_rate']:.2f}x; {ax['hit_rate_vs_round_robin']:.2f}x "
              f"round robin); predicted prefix length exact {ax['prediction_exact_pages']:.1%} vs "
              f"{ca['prediction_exact_pages']:.1%}")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "router_hit_rate", "args": vars(a), "working_set_tokens": working_set,
                               "machine": platform.platform(), "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
