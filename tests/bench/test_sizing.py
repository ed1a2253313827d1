"""``hicache bench``'s sizing line: the L2 read off the hit-rate curve, and the replay that checks it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from hicache.bench.sizing import SIZING_MARGIN, size_for_bound
from hicache.cli import main


@dataclass
class P:
    fraction: float
    capacity_tokens: int
    policy: float


CURVE = [P(0.1, 1000, 0.50), P(0.3, 3000, 0.79), P(0.5, 5000, 0.86), P(1.0, 10_000, 0.88)]


def test_the_smallest_sampled_capacity_within_the_margin_of_the_bound() -> None:
    s = size_for_bound(0.60, 0.88, 500, 0, CURVE)
    assert s is not None and (s.l2_tokens, s.fraction, s.curve_hit_rate) == (5000, 0.5, 0.86)
    assert s.checked_hit_rate is None and s.checked(0.85).checked_hit_rate == 0.85
    # never less than the L1: under write-through L2 holds a copy of L1 as well
    assert size_for_bound(0.60, 0.88, 7000, 0, CURVE).l2_tokens == 7000  # type: ignore[union-attr]


@pytest.mark.parametrize(("hit", "bound", "l2", "curve"), [
    (0.87, 0.88, 0, CURVE),  # close enough already
    (0.60, 0.95, 0, CURVE),  # the curve never comes within the margin
    (0.60, 0.88, 5000, CURVE),  # the configured L2 is that large already: not a capacity gap
    (0.60, 0.88, 0, []),  # no curve
])
def test_nothing_to_suggest(hit: float, bound: float, l2: int, curve: list[P]) -> None:
    assert size_for_bound(hit, bound, 500, l2, curve) is None


ARGS = ["bench", "--requests", "300", "--capacities", "10,20,30,50,100", "--l1", "10%", "--l3", "none", "--quiet"]


def run(tmp_path: Path, *extra: str) -> dict:  # type: ignore[type-arg]
    out = tmp_path / "r.json"
    assert main([*ARGS, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_following_the_suggestion_closes_the_gap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short = run(tmp_path, "--l2", "0")
    s = short["sizing"]
    assert s is not None and short["hit_rate"] < short["infinite"] - SIZING_MARGIN
    assert s["current_l2_tokens"] == 0 and s["l2_tokens"] >= s["l1_tokens"]
    assert s["checked_hit_rate"] >= s["curve_hit_rate"] - SIZING_MARGIN  # the estimate held when replayed
    text = " ".join(capsys.readouterr().out.split())
    assert "sizing:" in text and f"--l2 {s['l2_tokens']}" in text
    followed = run(tmp_path, "--l2", str(s["l2_tokens"]))
    assert followed["hit_rate"] == pytest.approx(s["checked_hit_rate"])
    assert followed["hit_rate"] >= followed["infinite"] - 2 * SIZING_MARGIN
    assert followed["sizing"] is None  # nothing more to suggest at that size


def test_a_write_policy_that_drops_pages_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = run(tmp_path, "--l2", "5%", "--write-policy", "write_through_selective")
    s = res["sizing"]
    assert s is not None and s["checked_hit_rate"] < s["curve_hit_rate"] - SIZING_MARGIN
    assert "--write-policy write_through" in " ".join(capsys.readouterr().out.split())
