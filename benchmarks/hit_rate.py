"""Hit rate of online eviction policies against the offline optimum: LRU, the default policy and Belady
side by side on the three workloads (multi-query RAG, few-shot, multi-turn chat) and the Mooncake trace,
at L1 capacities of 10%, 30% and 100% of each trace's working set (its distinct pages).

Each cell replays the trace through an in-process HiCache (L1 only, tiny KV layout, CPU); the optimum is
Belady on the prefix tree (``hicache.bench.optimal``) at the same capacity. LRU is the in-run baseline:
the table prints default/optimum (the target: >= 90%) and default/LRU. Two diagnostic columns show what
recency could do with a piece of the future that no online policy has (page-level simulations):
``admit-oracle`` is LRU that admits only pages some later prompt uses; ``dead-first`` is LRU that first
evicts pages no later prompt uses (finished conversations, documents never asked about again). Where
those stay under 90% of the optimum, the gap is Belady's knowledge of the future, not the policy.

    python benchmarks/hit_rate.py [--requests 600] [--mooncake PATH] [--json out/hit_rate.json]

Also available as ``hicache bench --policy-table [--trace PATH]``. ``benchmarks/online_bounds.py`` shows how
close policies told more than any online policy knows get to the optimum.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import OrderedDict
from pathlib import Path

from hicache.bench.optimal import INF, PagedTrace, _next_uses, page_trace
from hicache.bench.policy_table import DEFAULT_FRACTIONS, TARGET_RATIO, policy_table
from hicache.bench.traces import MOONCAKE_BLOCK, load_trace
from hicache.bench.workloads import WorkloadSpec, generate
from hicache.config import CacheConfig

MOONCAKE = Path(__file__).resolve().parents[1] / "data" / "mooncake" / "synthetic_trace.jsonl"


def lru_oracle_admission(pt: PagedTrace, capacity_pages: int) -> float:
    """Page-level LRU that admits only pages some later prompt uses (needs the future: diagnostic only)."""
    nu_p, nu_x = _next_uses(pt)
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for r in range(len(pt.prompt)):
        pp = pt.prompt[r]
        k = 0
        while k < len(pp) and pp[k] in cache:
            k += 1
        hits += k
        path, nus = pp + pt.extra[r], nu_p[r] + nu_x[r]
        for p, nu in reversed(list(zip(path, nus, strict=True))):  # parents end up more recent
            if p in cache:
                cache.move_to_end(p)
            elif nu < INF:
                cache[p] = None
        while len(cache) > capacity_pages:
            cache.popitem(last=False)
    return hits * pt.page_size / pt.total_prompt_tokens


def lru_dead_first(pt: PagedTrace, capacity_pages: int) -> float:
    """Page-level LRU that evicts pages with no later use first (needs the future: diagnostic only)."""
    nu_p, nu_x = _next_uses(pt)
    cache: dict[int, tuple[bool, int, int]] = {}  # page -> (used again, last request, -depth)
    hits = 0
    for r in range(len(pt.prompt)):
        pp = pt.prompt[r]
        k = 0
        while k < len(pp) and pp[k] in cache:
            k += 1
        hits += k
        path = pp + pt.extra[r]
        for d, (p, nu) in enumerate(zip(path, nu_p[r] + nu_x[r], strict=True)):
            cache[p] = (nu < INF, r, -d)
        excess = len(cache) - capacity_pages
        if excess > 0:
            cur = set(path)
            for _, p in sorted((v, p) for p, v in cache.items() if p not in cur)[:excess]:
                del cache[p]
            for p in reversed(path):  # the request alone is larger than the cache
                if len(cache) <= capacity_pages:
                    break
                cache.pop(p, None)
    return hits * pt.page_size / pt.total_prompt_tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=600, help="requests per workload")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mooncake", default=str(MOONCAKE), help="Mooncake trace ('' to skip)")
    ap.add_argument("--json", default="out/hit_rate.json")
    args = ap.parse_args()
    default = CacheConfig.eviction_policy
    policies = list(dict.fromkeys(["lru", default]))
    traces = [(w, generate(WorkloadSpec(w, args.requests, args.seed)), 64) for w in ("rag", "fewshot", "multiturn")]
    if args.mooncake and Path(args.mooncake).exists():
        traces.append(("mooncake", load_trace(args.mooncake), MOONCAKE_BLOCK))
    t0 = time.perf_counter()
    rows = policy_table(traces, policies, DEFAULT_FRACTIONS)
    wall = time.perf_counter() - t0
    paged = {name: page_trace(reqs, ps) for name, reqs, ps in traces}
    print(f"hit rate (prompt tokens), L1 only, page 64 (Mooncake: 512); {args.requests} requests per workload, "
          f"seed {args.seed}; default policy: {default}; {platform.processor() or platform.machine()}, {wall:.0f} s")
    head = (f"{'trace':10s} {'cap':>5s} {'lru':>7s} {default:>9s} {'optimum':>8s} {'dflt/opt':>9s} "
            f"{'lru/opt':>8s} {'dflt/lru':>9s} {'admit-oracle/opt':>17s} {'dead-first/opt':>15s} {'infinite':>9s}")
    print(head)
    out = []
    ok = True
    for r in rows:
        pt = paged[r.trace]
        cap = max(1, int(r.fraction * pt.num_pages))
        oracle, dead = lru_oracle_admission(pt, cap), lru_dead_first(pt, cap)
        d, lru = r.rates[default], r.rates["lru"]
        met = r.ratio(default) >= TARGET_RATIO - 1e-9
        ok &= met
        print(f"{r.trace:10s} {r.fraction:5.0%} {lru:7.1%} {d:9.1%} {r.optimal:8.1%} {r.ratio(default):9.0%} "
              f"{r.ratio('lru'):8.0%} {d / lru if lru else 1.0:9.2f} {oracle / r.optimal if r.optimal else 1:17.0%} "
              f"{dead / r.optimal if r.optimal else 1:15.0%} "
              f"{r.infinite:9.1%}{'' if met else '  < target'}")
        out.append(vars(r) | {"default": default, "default_over_optimal": r.ratio(default),
                              "lru_over_optimal": r.ratio("lru"), "oracle_admission_lru": oracle,
                              "oracle_dead_first_lru": dead, "target_met": met})
    print(f"target ({default} >= {TARGET_RATIO:.0%} of optimum everywhere): {'met' if ok else 'not met'}")
    p = Path(args.json)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"rows": out, "default_policy": default, "wall_s": wall, "target_met": ok}, indent=2))
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
