"""The SGLang storage benchmark at a tiny size, in the engines' interpreter: every path has its figures in
the JSON, every round trip was compared byte for byte, and a damaged read aborts it (status 1). Without
SGLang it exits with status 2 and says how to get it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "engine_storage.py"
VENV_PY = ROOT / ".venv-engines" / "bin" / "python"
TINY = ["--layers", "2", "--heads", "1", "--head-dim", "8", "--page-size", "4", "--pages", "8", "--batch", "4",
        "--rounds", "2"]
PATHS = {"hicache v1", "raw backend", "sglang file", "hicache flat"}
LAYOUTS = {"page_first", "layer_first", "page_first_direct"}

# SGLang takes ~10 s to import on CPU: one interpreter runs the benchmark twice (clean, then with a fault)
DRIVER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("engine_storage", sys.argv[1])
m = importlib.util.module_from_spec(spec)
sys.modules["engine_storage"] = m
spec.loader.exec_module(m)
out, tiny = sys.argv[2], sys.argv[3:]
print("clean-rc", m.main([*tiny, "--json", out]), flush=True)
print("fault-rc", m.main([*tiny, "--layouts", "layer_first", "--json", out + ".fault", "--inject-fault"]))
"""


def engine_python() -> str:
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable
    if VENV_PY.exists():
        return str(VENV_PY)
    pytest.skip("sglang is not importable here and .venv-engines is absent (bash scripts/engine_env.sh)")


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_every_path_is_measured_and_verified_and_a_bad_read_aborts(tmp_path: Path) -> None:
    out = tmp_path / "engine_storage.json"
    p = run([engine_python(), "-c", DRIVER, str(SCRIPT), str(out), *TINY], timeout=120)
    assert "clean-rc 0" in p.stdout, p.stdout + p.stderr
    d = json.loads(out.read_text())
    rows = d["rows"]
    assert {(r["layout"], r["path"]) for r in rows} == {(la, pa) for la in LAYOUTS for pa in PATHS}
    for r in rows:
        assert r["pages"] == 8 and r["page_bytes"] == 2 * 2 * 4 * 8 * 2
        assert len(r["set_s_rounds"]) == len(r["get_s_rounds"]) == 2
        assert len(r["set_s_batches"]) == len(r["get_s_batches"]) == 2 * 2  # (8 pages in batches of 4)
        assert sum(r["set_s_batches"]) == pytest.approx(sum(r["set_s_rounds"]))
        for k in ("set_pages_per_s", "get_pages_per_s", "set_gbps", "get_gbps"):
            assert r[k] > 0, (r, k)
    assert {q["layout"] for q in d["ratios"]} == LAYOUTS
    for q in d["ratios"]:
        assert all(q[k] > 0 for k in ("adapter_over_raw_set", "adapter_over_raw_get", "v1_over_sglang_file_set",
                                      "v1_over_sglang_file_get", "flat_over_sglang_file_set",
                                      "flat_over_sglang_file_get"))
    # every run of every path (3 layouts x 4 paths x 2 rounds) compared both whole pools
    assert d["verified"]["runs"] == 24 and d["verified"]["pages"] == 24 * 8 and d["verified"]["bytes"] > 0
    c = d["conditions"]
    assert c["cpus"] and c["sglang"] not in ("", "-") and c["torch"] and c["page_bytes"] == rows[0]["page_bytes"]
    assert "warm" in c["page_cache"]

    assert "fault-rc 1" in p.stdout, p.stdout + p.stderr
    assert "round trip failed" in p.stderr and "differ" in p.stderr, p.stderr
    assert not Path(str(out) + ".fault").exists()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is importable here")
def test_without_sglang_it_exits_2_and_says_how_to_get_it(tmp_path: Path) -> None:
    p = run([sys.executable, str(SCRIPT), *TINY, "--json", str(tmp_path / "x.json")], timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "scripts/engine_env.sh" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()
