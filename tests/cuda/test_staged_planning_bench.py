"""The staged-planning benchmark (CPU only) plans every staging of the same allocated pages: copies and
planning time come out for each, as ratios to the page-first plan; mirrored slots never make more
copies than lc-major ones, and about as few chunks even when the pages are scattered."""

import json
from pathlib import Path
from types import ModuleType

from scriptload import load_script


def _load() -> ModuleType:
    return load_script("benchmarks/staged_planning.py", "staged_planning_bench")


def test_small_run_reports_every_staging(tmp_path: Path) -> None:
    out = tmp_path / "planning.json"
    rc = _load().main(["--pieces", "4", "16", "--total-mib", "16", "--pool-pages", "4096", "--reps", "2",
                       "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["piece_kib"], r["frees"], r["staging"]) for r in rows} == {
        (k, f, s) for k in (4, 16) for f in ("random", "lru", "scattered")
        for s in ("page_first", "lc_major", "mirror")}
    for r in rows:
        if r["staging"] == "page_first":
            assert r["load_copies_ratio"] == 1.0 and r["backup_copies_ratio"] == 1.0
    by = {(r["piece_kib"], r["frees"], r["staging"]): r for r in rows}
    for k in (4, 16):
        for f in ("random", "lru", "scattered"):
            for op in ("load", "backup"):
                mirror, lc = by[(k, f, "mirror")], by[(k, f, "lc_major")]
                assert mirror[f"{op}_copies"] <= lc[f"{op}_copies"]
                # partial blocks are packed into the slots: no chunk per few scattered pages
                assert mirror[f"{op}_chunks"] <= lc[f"{op}_chunks"] + lc[f"{op}_chunks"] // 8 + 1
