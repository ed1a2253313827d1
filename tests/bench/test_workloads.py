"""Workloads are deterministic by seed and have the reuse structure each one stands for."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hicache.bench.errors import BenchInputError
from hicache.bench.optimal import infinite, page_trace
from hicache.bench.tokenizer import WordTokenizer
from hicache.bench.workloads import WORKLOADS, WorkloadSpec, generate


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.tokens, y.tokens) and np.array_equal(x.output, y.output) and x.timestamp == y.timestamp
        for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", WORKLOADS)
def test_deterministic_by_seed(name: str) -> None:
    a = generate(WorkloadSpec(name, 60, seed=7))
    b = generate(WorkloadSpec(name, 60, seed=7))
    c = generate(WorkloadSpec(name, 60, seed=8))
    assert len(a) == 60
    assert _same(a, b)
    assert not _same(a, c)
    assert all(r.tokens.dtype == np.uint32 for r in a)
    assert [r.timestamp for r in a] == sorted(r.timestamp for r in a)


@pytest.mark.parametrize("name", WORKLOADS)
def test_prompts_share_prefixes(name: str) -> None:
    reqs = generate(WorkloadSpec(name, 200))
    assert infinite(page_trace(reqs, 16)).hit_rate > 0.5


def test_multiturn_prompt_extends_previous_turn() -> None:
    reqs = generate(WorkloadSpec("multiturn", 100))
    by_session: dict[str, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    pairs = [(a, b) for turns in by_session.values() for a, b in itertools.pairwise(turns)]
    assert pairs
    for a, b in pairs:
        whole = np.concatenate([a.tokens, a.output])
        assert np.array_equal(b.tokens[: len(whole)], whole)


def test_planted_timestamp_is_at_the_start() -> None:
    tok = WordTokenizer()
    plain = generate(WorkloadSpec("rag", 20, rate=0.5), tok)
    planted = generate(WorkloadSpec("rag", 20, rate=0.5, volatile="timestamp"), tok)
    assert tok.decode(planted[0].tokens[:3].tolist()) == "Current time:"
    assert infinite(page_trace(planted, 16)).hit_rate < infinite(page_trace(plain, 16)).hit_rate - 0.2


@pytest.mark.parametrize("bad", [dict(name="chat"), dict(requests=0), dict(volatile="weather")])
def test_bad_spec(bad: dict) -> None:
    with pytest.raises(BenchInputError):
        WorkloadSpec(**bad)
