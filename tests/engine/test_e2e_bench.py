"""The end-to-end benchmark's smoke mode (tiny model on the CPU) runs every mode, Redis included, and
reports what the cache did: hits on the shared prefix, and the L3 tiers serving what L1 and L2 dropped."""

import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from scriptload import load_script

pytestmark = pytest.mark.redis


def _load() -> ModuleType:
    return load_script("benchmarks/e2e_rag.py", "e2e_rag_bench")


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_quick_run_covers_every_mode(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    rc = _load().main(["--quick", "--workloads", "rag,rag_ws", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["errors"] == []
    assert res["conditions"]["redis"].startswith("redis://127.0.0.1:")
    rows = {(r["workload"], r["mode"]): r for r in res["rows"]}
    assert set(rows) == {("rag", m) for m in ("nocache", "l1", "l1l2", "l1l2l3", "l1l2redis")} | {
        ("rag_ws", m) for m in ("l1", "l1l2", "l1l2l3", "l1l2redis")}
    assert rows[("rag", "nocache")]["hit_rate_total"] == 0
    for mode in ("l1", "l1l2", "l1l2l3", "l1l2redis"):
        r = rows[("rag", mode)]
        assert r["hit_rate_total"] > 0.5, (mode, r["hit_rate"])  # the document is shared by every question
        assert r["ideal_speedup"] > 2
    for mode in ("l1l2l3", "l1l2redis"):  # the working set exceeds L1 + L2 there: L3 must serve some of it
        assert rows[("rag_ws", mode)]["hit_rate"]["l3"] > 0, mode
    assert rows[("rag_ws", "l1")]["hit_rate"]["l3"] == 0


def test_redis_off_leaves_the_mode_out(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    rc = _load().main(["--quick", "--workloads", "fewshot", "--modes", "l1,l1l2redis", "--redis", "off",
                       "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["mode"] for r in res["rows"]] == ["l1"]
