"""The router-events benchmark indexes the same pages through both paths: an engine's KV events and a
hicache node's event stream end with the same keys in the index."""

from __future__ import annotations

import json
from pathlib import Path

from hicache.bench.workloads import WorkloadSpec, generate
from hicache.router.kv_events import decode_batch
from scriptload import load_script

bench = load_script("benchmarks/router_events.py", "router_events_bench")


def test_both_paths_index_the_same_pages(tmp_path: Path) -> None:
    prompts = [q.tokens for q in generate(WorkloadSpec("fewshot", 60, 0))]  # the benchmark's seed
    probe = bench.new_router(8)
    node_events, payloads, pages = bench.streams(prompts, probe)
    a, b = bench.new_router(8), bench.new_router(8)
    for ev in node_events:
        a.apply_event("n0", ev)
    for p in payloads:
        b.engines["e0"].apply(decode_batch(p))
    assert pages > 0 and set(a.index.feed("n0").pages) == set(b.index.feed("e0").pages)
    assert len(b.index.feed("e0").pages) == pages
    out = tmp_path / "ev.json"
    assert bench.main(["--workload", "fewshot", "--requests", "60", "--page-size", "8", "--reps", "1",
                       "--json", str(out)]) == 0
    assert json.loads(out.read_text())["pages"] == pages
