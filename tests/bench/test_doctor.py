"""The doctor finds a timestamp planted early in the prompt, what most often breaks prefix reuse, and its fix helps."""

from __future__ import annotations

import pytest

from hicache.bench.doctor import classify, run_doctor
from hicache.bench.tokenizer import WordTokenizer
from hicache.bench.workloads import WorkloadSpec, generate


@pytest.mark.parametrize("workload", ["rag", "fewshot", "mixed"])
def test_finds_planted_timestamp_and_fix_raises_hit_rate(workload: str) -> None:
    tok = WordTokenizer()
    reqs = generate(WorkloadSpec(workload, 150, rate=1.0, volatile="timestamp"), tok)
    rep = run_doctor(reqs, 16, tok.token_text, capacity_tokens=None)
    assert rep.groups, "nothing found"
    top = rep.groups[0]
    assert top.kind == "timestamp"
    assert top.median_position <= 3  # right at the start of the prompt
    assert "Current time" in top.context
    assert rep.after_infinite > rep.before_infinite + 0.3
    assert rep.before_infinite < 0.6 and "fix the prompt structure" in rep.advice


def test_clean_prompts_need_tiers_not_fixes() -> None:
    tok = WordTokenizer()
    reqs = generate(WorkloadSpec("rag", 150), tok)
    rep = run_doctor(reqs, 16, tok.token_text, capacity_tokens=2048)
    assert not [g for g in rep.groups if g.kind == "timestamp"]
    assert rep.after_infinite == pytest.approx(rep.before_infinite)
    assert rep.before_capacity is not None and rep.before_capacity < rep.before_infinite
    assert "add tiers" in rep.advice


def test_session_id_found_on_opaque_ids_without_text() -> None:
    reqs = generate(WorkloadSpec("fewshot", 120, volatile="request_id"))
    rep = run_doctor(reqs, 16, token_text=None)  # token ids only: spans are found, not named
    assert rep.groups and rep.groups[0].count > 100
    assert rep.after_infinite > rep.before_infinite + 0.5


@pytest.mark.parametrize(("text", "kind"), [
    ("2026-12-02 09:00:01", "timestamp"), ("09:00", "timestamp"), ("3f2a9c1b7e", "hex id"),
    ("123456", "number / numeric id"), ("Alice Smith", "name"), ("<123> <456>", "opaque tokens"),
])
def test_classify(text: str, kind: str) -> None:
    assert classify(text) == kind
