"""The online-bounds benchmark's simulated caches are real prefix caches: whatever they are told, none
hits more than Belady at the same capacity, every one reaches the infinite bound when all pages fit, and
the page set stays prefix-closed and within capacity."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.bench.optimal import belady, infinite, page_trace
from hicache.bench.workloads import TraceRequest, WorkloadSpec, generate
from scriptload import load_script

PAGE = 2
ob = load_script("benchmarks/online_bounds.py", "online_bounds_bench")


@st.composite
def traces(draw: st.DrawFn) -> list[TraceRequest]:
    stems = draw(st.lists(st.lists(st.integers(0, 3), max_size=8), min_size=1, max_size=4))
    reqs = []
    for i in range(draw(st.integers(1, 14))):
        tail = draw(st.lists(st.integers(0, 3), max_size=8))
        out = draw(st.lists(st.integers(0, 3), max_size=4))
        reqs.append(TraceRequest(np.array(draw(st.sampled_from(stems)) + tail, np.uint32), np.array(out, np.uint32),
                                 session=str(i % 3)))
    return reqs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=traces(), cap=st.integers(1, 12))
def test_no_simulated_policy_beats_the_optimum(reqs: list[TraceRequest], cap: int) -> None:
    pt = page_trace(reqs, PAGE)
    opt = belady(pt, cap).hit_rate
    for rate in (ob.lru(pt, cap), ob.fitted(pt, cap), ob.law_aware(reqs, pt, cap)):
        assert 0.0 <= rate <= opt + 1e-12
    assert ob.window_oracle(pt, cap) <= infinite(pt).hit_rate + 1e-12


def test_every_policy_reaches_the_infinite_bound_when_all_fits() -> None:
    reqs = generate(WorkloadSpec("multiturn", 80, 3))
    pt = page_trace(reqs, 64)
    inf = infinite(pt).hit_rate
    assert inf > 0.5
    for rate in (ob.lru(pt, pt.num_pages), ob.fitted(pt, pt.num_pages), ob.law_aware(reqs, pt, pt.num_pages)):
        assert abs(rate - inf) < 1e-12


def test_leaf_cache_stays_prefix_closed_and_within_capacity() -> None:
    reqs = generate(WorkloadSpec("rag", 120, 1))
    pt = page_trace(reqs, 64)
    cap = pt.num_pages // 10
    seen: list[tuple[int, int]] = []
    real = ob.LeafCache

    class Checked(real):  # type: ignore[misc,valid-type]
        def remove(self, p: int) -> None:
            assert self.kids[p] == 0, "evicted a page whose child is cached"
            super().remove(p)
            seen.append((len(self), sum(1 for q in self.kids if self.parent[q] not in self.kids and
                                             self.parent[q] != -1)))

    ob.LeafCache = Checked
    try:
        ob.lru(pt, cap)
    finally:
        ob.LeafCache = real
    assert seen and all(orphans == 0 for _, orphans in seen)
    assert max(n for n, _ in seen) <= cap + max(len(p) + len(x) for p, x in zip(pt.prompt, pt.extra, strict=True))


def test_small_run_writes_every_row(tmp_path: Path) -> None:
    out = tmp_path / "bounds.json"
    assert ob.main(["--requests", "60", "--seeds", "0", "--mooncake", "", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["trace"], r["fraction"]) for r in rows} == {(t, f) for t in ("rag/0", "multiturn/0")
                                                          for f in ob.FRACTIONS}
    for r in rows:
        assert all(r[k] <= r["optimal"] + 1e-12 for k in ("lru", "fitted"))
        assert (r["law"] is None) == r["trace"].startswith("rag")
