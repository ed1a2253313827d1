"""PNG plot of a bench result (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from hicache.bench.run import BenchResult


def plot_result(res: BenchResult, path: Path) -> Path:
    """Left: hit rate vs L1 capacity (policy, optimum, infinite bound; the 60% line of the advice). Right:
    this run's hit rate stacked by tier, next to the optimum and the infinite bound."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [p.fraction * 100 for p in res.curve]
    a.plot(xs, [p.policy * 100 for p in res.curve], "o-", label=f"{res.policies['eviction']} (online)")
    a.plot(xs, [p.optimal * 100 for p in res.curve], "s--", label="offline optimum (Belady)")
    a.axhline(res.infinite * 100, color="grey", linestyle=":", label="infinite capacity")
    a.axhline(60, color="red", alpha=0.3, linewidth=1)
    a.set_xlabel("L1 capacity (% of working set)")
    a.set_ylabel("token hit rate (%)")
    a.set_ylim(0, 100)
    a.set_title("Hit rate vs capacity")
    a.legend(loc="lower right", fontsize=8)
    tiers = ["l1", "l2", "l3"]
    vals = [res.tiers[t]["token_rate"] * 100 for t in tiers]
    bottom = 0.0
    for t, v in zip(tiers, vals, strict=True):
        b.bar(["this run"], [v], bottom=bottom, label=t.upper())
        bottom += v
    b.bar(["optimum"], [res.optimal_same_capacity * 100], color="grey", alpha=0.5, label="optimum")
    b.bar(["infinite"], [res.infinite * 100], color="black", alpha=0.3, label="infinite")
    b.set_ylim(0, 100)
    b.set_title("Hit rate by tier")
    b.legend(fontsize=8)
    fig.suptitle(res.source, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
