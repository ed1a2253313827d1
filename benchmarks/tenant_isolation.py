"""A noisy neighbour: one tenant's hit rate while another floods the cache, with and without a share cap.

Tenant ``acme`` runs the RAG workload (documents reused across questions); tenant ``batch`` is a heavier
neighbour, ``--flood`` requests per acme request, interleaved: by default its own RAG workload with
documents twice as long (``--noisy``, ``--scale``), or ``--noisy oneoff``: prompts no one sends twice (a
scan, a crawler; the default eviction policy already evicts those first, so they hurt acme little).
Each run replays that through one in-process HiCache (CPU, tiny KV layout: the hit rates do not depend
on it) with L1 and L2 sized to a fraction of acme's working set and the default
eviction and write policies; every request runs as an engine runs it (match, load L2 -> L1, compute the
rest, commit, release).

Runs: acme alone (the in-run baseline), acme with the flood and no ``cache.tenant_shares``, and acme with
the flood and ``tenant_shares: {batch: --share}``. Printed: acme's hit rate (prompt tokens found on L1 or
L2) per run and as a ratio to running alone, and batch's own hit rate (what the cap costs it).

    python benchmarks/tenant_isolation.py [--requests 600] [--flood 2] [--noisy rag] [--share 0.2]
                                          [--json out/tenant_isolation.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from hicache.bench.optimal import page_trace
from hicache.bench.workloads import WorkloadSpec, generate
from hicache.cache import HiCache
from hicache.config import config_from_dict

PAGE = 64


def run(reqs: list[tuple[str, np.ndarray]], l1: int, l2: int, shares: dict[str, float]) -> dict[str, float]:
    cfg = config_from_dict({
        "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 2, "dtype": "float16", "page_size": PAGE},
        "cache": {"l1_tokens": l1, "l2_tokens": l2, "tenant_shares": shares},
    })
    cache = HiCache(cfg)
    hit: dict[str, int] = {}
    total: dict[str, int] = {}
    try:
        for tenant, tokens in reqs:
            ns = cache.namespace(tenant)
            req = cache.match(tokens, ns, l3=False)
            load = cache.load_back(req)
            load.wait()
            n = len(tokens) // PAGE
            new = cache.alloc(req, n - len(load.device_indices))
            cache.commit(req, tokens, np.concatenate([load.device_indices, new]))
            cache.release(req)
            hit[tenant] = hit.get(tenant, 0) + (req.l1_pages + req.l2_pages) * PAGE
            total[tenant] = total.get(tenant, 0) + len(tokens)
        cache.check_integrity()
    finally:
        cache.close()
    return {t: hit[t] / total[t] for t in total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=600, help="acme's requests")
    ap.add_argument("--flood", type=int, default=2, help="batch's requests per acme request")
    ap.add_argument("--share", type=float, default=0.2, help="batch's share of L1 and L2 in the capped run")
    ap.add_argument("--l1", type=float, default=0.3, help="L1 as a fraction of acme's working set")
    ap.add_argument("--l2", type=float, default=0.6, help="L2 as a fraction of acme's working set")
    ap.add_argument("--noisy", default="rag", choices=["rag", "multiturn", "fewshot", "oneoff"],
                    help="batch's workload (its own documents), or one-off prompts")
    ap.add_argument("--scale", type=float, default=2.0, help="batch's spans, relative to acme's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="out/tenant_isolation.json")
    args = ap.parse_args()

    acme = generate(WorkloadSpec("rag", args.requests, args.seed))
    ws = page_trace(acme, PAGE).working_set_tokens
    l1, l2 = int(args.l1 * ws) // PAGE * PAGE, int(args.l2 * ws) // PAGE * PAGE
    rng = np.random.default_rng(args.seed + 1)
    alone: list[tuple[str, np.ndarray]] = [("acme", r.tokens) for r in acme]
    mixed: list[tuple[str, np.ndarray]] = []
    heavy = iter(generate(WorkloadSpec(args.noisy, args.requests * args.flood, args.seed + 7, scale=args.scale))
                 if args.noisy != "oneoff" else [])
    for r in acme:
        mixed.append(("acme", r.tokens))
        for _ in range(args.flood):
            if args.noisy == "oneoff":  # random ids, acme's prompt length
                mixed.append(("batch", rng.integers(1, 1 << 31, size=len(r.tokens), dtype=np.uint32)))
            else:
                mixed.append(("batch", next(heavy).tokens))

    t0 = time.perf_counter()
    results: dict[str, dict[str, float]] = {
        "alone": run(alone, l1, l2, {}),
        "flood, no shares": run(mixed, l1, l2, {}),
        f"flood, batch share {args.share:g}": run(mixed, l1, l2, {"batch": args.share}),
    }
    wall = time.perf_counter() - t0
    base = results["alone"]["acme"]
    what = "one-off prompts" if args.noisy == "oneoff" else f"{args.noisy} requests (spans x{args.scale:g})"
    print(f"acme: RAG, {args.requests} requests, working set {ws / 1000:.0f}k tokens; batch: {args.flood} {what} "
          f"per acme request; L1 {l1 / 1000:.0f}k tokens ({args.l1:.0%}), L2 {l2 / 1000:.0f}k "
          f"({args.l2:.0%}); page {PAGE}; {platform.processor() or platform.machine()}, {wall:.1f} s")
    print(f"{'run':28s} {'acme hit':>9s} {'vs alone':>9s} {'batch hit':>10s}")
    rows: list[dict[str, Any]] = []
    for name, r in results.items():
        ratio = r["acme"] / base if base else 1.0
        b = r.get("batch")
        print(f"{name:28s} {r['acme']:9.1%} {ratio:9.2f} {'-' if b is None else f'{b:.1%}':>10s}")
        rows.append({"run": name, "acme_hit_rate": r["acme"], "acme_vs_alone": ratio, "batch_hit_rate": b})
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "working_set_tokens": ws, "l1_tokens": l1, "l2_tokens": l2,
                               "rows": rows, "wall_s": wall}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
