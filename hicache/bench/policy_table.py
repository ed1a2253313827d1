"""LRU, the default eviction policy and the offline optimum side by side, at shares of the working set.

For each workload (and the ``--trace`` file when given) and each capacity, an in-process L1-only cache is
replayed once per policy; the optimum is Belady at the same capacity (:mod:`~hicache.bench.optimal`).
The target: the default policy (online) reaches at least 90% of the optimum everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hicache.bench.optimal import belady, infinite, page_trace
from hicache.bench.run import policy_hit_rate
from hicache.bench.workloads import TraceRequest

TARGET_RATIO = 0.90
DEFAULT_FRACTIONS = (0.1, 0.3, 1.0)


@dataclass
class Row:
    trace: str
    fraction: float
    capacity_tokens: int
    rates: dict[str, float]  # policy -> hit rate
    optimal: float
    infinite: float

    def ratio(self, policy: str) -> float:
        return self.rates[policy] / self.optimal if self.optimal else 1.0


def policy_table(traces: Sequence[tuple[str, Sequence[TraceRequest], int]], policies: Sequence[str],
                 fractions: Sequence[float] = DEFAULT_FRACTIONS,
                 tick: Callable[[str], None] | None = None) -> list[Row]:
    """``traces``: (name, requests, page size). One row per trace and capacity."""
    rows = []
    for name, reqs, ps in traces:
        pt = page_trace(reqs, ps)
        inf = infinite(pt).hit_rate
        for f in fractions:
            pages = max(1, int(f * pt.num_pages))
            rates = {p: policy_hit_rate(reqs, ps, pages * ps, p) for p in policies}
            rows.append(Row(name, f, pages * ps, rates, belady(pt, pages).hit_rate, inf))
            if tick is not None:
                tick(f"{name} {f:.0%}")
    return rows
