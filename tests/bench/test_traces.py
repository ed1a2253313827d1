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
