"""benchmarks/route_latency.py --quick: a real ``hicache route`` over 8 in-process nodes answers every
phase (health baseline and Route, closed and open loop) without errors, and the JSON has its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_route_latency_quick(tmp_path: Path) -> None:
    out = tmp_path / "route_latency.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "route_latency.py"), "--quick", "--json",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["benchmark"] == "route_latency" and r["quick"] and r["cpus"] >= 1
    mem = r["index_memory"]
    assert mem["node_pages"] > 0 and mem["bytes"] > 0 and mem["bytes_per_1m_pages"] > 0
    assert r["in_process"]["req_per_s"] > 0
    levels = {(x["kind"], x["loop"]): x for x in r["grpc"]}
    assert set(levels) == {("health", "closed"), ("route", "closed"), ("health", "open"), ("route", "open")}
    for x in levels.values():
        assert x["errors"] == 0 and x["requests"] > 0 and x["req_per_s"] > 0
        assert 0 < x["p50_ms"] <= x["p99_ms"]
    for loop in ("closed", "open"):
        route = levels[("route", loop)]
        assert route["vs_health_rate"] > 0 and route["prefix_share"] > 0  # routes found cached prefixes
        assert route["reasons"].get("prefix", 0) > 0
