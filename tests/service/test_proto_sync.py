"""The committed generated code is exactly what scripts/gen_proto.sh makes from proto/."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .service_harness import REPO

pytest.importorskip("grpc_tools")


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    subprocess.run([str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, cwd=REPO)
    committed = REPO / "hicache" / "proto_gen"
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*.py*") if "__pycache__" not in p.parts}
    have = {p.relative_to(committed): p.read_bytes() for p in committed.rglob("*.py*")
            if "__pycache__" not in p.parts}
    assert sorted(fresh) == sorted(have), "generated files differ: run scripts/gen_proto.sh"
    stale = [str(k) for k in fresh if fresh[k] != have[k]]
    assert not stale, f"{stale} out of date with proto/: run scripts/gen_proto.sh"
