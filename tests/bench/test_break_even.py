"""``hicache bench`` says when a tier's hits cost more time to load than to recompute, at the assumed rates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.cli import main

ARGS = ["bench", "--requests", "200", "--capacities", "", "--l1", "5%", "--l2", "5%", "--l3", "memory", "--quiet"]


def run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[str, dict]:  # type: ignore[type-arg]
    out = tmp_path / "r.json"
    assert main([*ARGS, *extra, "--json", str(out)]) == 0
    return " ".join(capsys.readouterr().out.split()), json.loads(out.read_text())


def test_a_store_slower_than_recomputing_is_named_with_its_break_even(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    text, res = run(tmp_path, capsys, "--l3-bandwidth", "1e9", "--prefill-rate", "40000")
    assert res["tiers"]["l3"]["tokens"] > 0
    need = res["bytes_per_token"] * 40000 / 1e9  # 128 KiB x 40k tokens/s = 5.2 GB/s
    assert "L3 hits cost time" in text and f"L3 pays off above {need:.1f} GB/s" in text
    assert "L2 hits cost time" not in text  # 50 GB/s: far above it


def test_a_fast_enough_store_gets_no_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, res = run(tmp_path, capsys, "--l3-bandwidth", "20e9", "--prefill-rate", "40000")
    assert res["tiers"]["l3"]["tokens"] > 0 and "cost time" not in text
    # the same hits at the slower rate save less time: the note and the saved seconds agree
    _, slow = run(tmp_path, capsys, "--l3-bandwidth", "1e9", "--prefill-rate", "40000")
    assert slow["prefill_seconds_saved"] < res["prefill_seconds_saved"]
