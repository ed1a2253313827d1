"""Trace loading: Mooncake's hash_ids format, the own JSONL (ids or text), and errors naming file:line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hicache.bench.errors import BenchInputError
from hicache.bench.traces import MOONCAKE_BLOCK, block_tokens, load_trace


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_mooncake_blocks_map_to_shared_tokens(tmp_path: Path) -> None:
    p = _write(tmp_path / "m.jsonl", [
        {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [3, 4, 5]},
        {"timestamp": 1500, "input_length": 1024, "output_length": 5, "hash_ids": [3, 4]},
        {"timestamp": 2500, "input_length": 600, "output_length": 5, "hash_ids": [3, 9]},
    ])
    a, b, c = load_trace(p)
    assert (a.kind, len(a.tokens), len(b.tokens), len(c.tokens)) == ("mooncake", 1100, 1024, 600)
    assert [a.timestamp, b.timestamp, c.timestamp] == [0.0, 0.5, 1.5]  # ms, relative to the first
    assert np.array_equal(a.tokens[:1024], b.tokens)  # same hash_ids prefix -> same tokens
    assert np.array_equal(a.tokens[:512], c.tokens[:512])
    assert not np.array_equal(a.tokens[512:600], c.tokens[512:600])
    assert np.array_equal(block_tokens(np.array([4])), a.tokens[MOONCAKE_BLOCK: 2 * MOONCAKE_BLOCK])
    assert len(load_trace(p, limit=2)) == 2


def test_own_jsonl_ids_and_text(tmp_path: Path) -> None:
    p = _write(tmp_path / "t.jsonl", [
        {"timestamp": 2.0, "tokens": [1, 2, 3], "output": [4], "session": "s"},
        {"timestamp": 3.0, "prompt": "Hello world. Hello!", "output_text": "Hi"},
    ])
    a, b = load_trace(p)
    assert a.tokens.tolist() == [1, 2, 3] and a.output.tolist() == [4] and a.session == "s"
    assert b.kind == "text" and len(b.tokens) == 5 and b.tokens[0] == b.tokens[3] and b.timestamp == 1.0


@pytest.mark.parametrize(("rows", "where"), [
    (['{"tokens": [1]}', "{not json"], ":2: not valid JSON"),
    (['{"tokens": [1]}', "[1, 2]"], ":2: expected a JSON object"),
    (['{"tokens": [1, -3]}'], ":1: 'tokens' holds ids outside"),
    (['{"tokens": ["a"]}'], ":1: 'tokens' must be a list"),
    (['{"hash_ids": [1, 2], "input_length": 5000}'], ":1: 'input_length' 5000 does not fit 2 blocks"),
    (['{"nothing": 1}'], ":1: needs 'tokens'"),
    ([""], "no requests"),
])
def test_errors_name_file_and_line(tmp_path: Path, rows: list, where: str) -> None:
    p = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(BenchInputError, match=f"{p}{where}" if where.startswith(":") else where):
        load_trace(p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(BenchInputError, match="no such file"):
        load_trace(tmp_path / "nope.jsonl")


MOONCAKE_LINE = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [3, 9]}


@pytest.mark.parametrize(("rows", "line", "this", "first_line", "first"), [
    ([{"tokens": [1, 2]}, {"prompt": "text"}, "", MOONCAKE_LINE], 4, "Mooncake", 1, "own JSONL"),
    ([MOONCAKE_LINE, MOONCAKE_LINE, {"timestamp": 1.0, "tokens": [1]}], 3, "own JSONL", 1, "Mooncake"),
    (["", MOONCAKE_LINE, {"prompt": "text"}], 3, "own JSONL", 2, "Mooncake"),
])
def test_mixed_formats_name_the_line_where_it_changes(tmp_path: Path, rows: list, line: int, this: str,
                                                      first_line: int, first: str) -> None:
    """Own-format and Mooncake lines in one file (seconds vs milliseconds, ids vs hash_ids) are refused at
    the first line whose format differs from the first request's."""
    p = _write(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(BenchInputError) as e:
        load_trace(p)
    msg = str(e.value)
    assert msg.startswith(f"trace {p}:{line}: the format changes here: this line is {this}"), msg
    assert f"the first request (line {first_line}) is {first}" in msg and "a trace holds one format" in msg, msg
    before = sum(1 for r in rows[:line - 1] if r)
    assert len(load_trace(p, limit=before)) == before  # a --limit that stops before the change reads


def test_line_with_both_formats_needs_format(tmp_path: Path) -> None:
    p = _write(tmp_path / "both.jsonl", [{**MOONCAKE_LINE, "tokens": [1, 2, 3]}])
    with pytest.raises(BenchInputError, match=f"{p}:1: has both 'hash_ids' \\(Mooncake\\) and 'tokens'"):
        load_trace(p)
    assert load_trace(p, fmt="mooncake")[0].kind == "mooncake"  # --format says which
    assert load_trace(p, fmt="jsonl")[0].tokens.tolist() == [1, 2, 3]


def test_each_format_alone_still_reads_with_auto_and_explicit_format(tmp_path: Path) -> None:
    own = _write(tmp_path / "own.jsonl", [{"tokens": [1, 2]}, {"prompt": "a b"}, {"tokens": [3]}])
    moon = _write(tmp_path / "moon.jsonl", [MOONCAKE_LINE, {**MOONCAKE_LINE, "timestamp": 10}])
    assert [r.kind for r in load_trace(own)] == [r.kind for r in load_trace(own, fmt="jsonl")] == \
        ["jsonl", "text", "jsonl"]
    assert [r.kind for r in load_trace(moon)] == [r.kind for r in load_trace(moon, fmt="mooncake")] == \
        ["mooncake", "mooncake"]
    with pytest.raises(BenchInputError, match=f"{moon}:1: a Mooncake line \\(hash_ids\\) read as --format jsonl"):
        load_trace(moon, fmt="jsonl")
