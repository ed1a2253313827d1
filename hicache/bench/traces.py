"""Trace files: the bench's own JSONL and Mooncake's hash_ids JSONL.

Own format, one JSON object per line (``timestamp`` in seconds, optional; ``session`` optional)::

    {"timestamp": 0.0, "tokens": [1, 2, 3], "output": [4, 5]}
    {"timestamp": 0.5, "prompt": "text ...", "output_text": "..."}      # text, needs a tokenizer

Mooncake format (``timestamp`` in milliseconds)::

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, 2, ...]}

Each hash id names one 512-token block *and its whole prefix* (Mooncake's ids are chained). A block is
mapped to 512 token ids by a fixed function of its id, so two requests share exactly the tokens of their
common hash_ids prefix; the last block is cut to ``input_length``. Output tokens of a Mooncake request are
unknown, so nothing is cached for them.

A trace holds one format: with ``fmt="auto"`` its first request decides which, and a later line in the
other format is an error naming that line (the two formats count time in different units and only
Mooncake's requests share tokens through hash_ids, so a mixed file would replay as nonsense). So is a
line with both ``hash_ids`` and the own format's ``tokens`` / ``prompt`` / ``text``: ``--format`` says which
to read.

Errors are :class:`BenchInputError` naming the file and line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hicache.bench.errors import BenchInputError
from hicache.bench.tokenizer import Tokenizer, WordTokenizer
from hicache.bench.workloads import TraceRequest

MOONCAKE_BLOCK = 512
FORMATS = ("auto", "jsonl", "mooncake")
_M = np.uint64(0xFFFFFFFFFFFFFFFF)


def block_tokens(hash_ids: np.ndarray, block: int = MOONCAKE_BLOCK) -> np.ndarray:
    """Token ids of the blocks ``hash_ids`` (``[len * block]``): splitmix64 of (id, position), 31 bits."""
    h = np.asarray(hash_ids, dtype=np.uint64)
    x = (h[:, None] * np.uint64(block) + np.arange(block, dtype=np.uint64)[None, :]).reshape(-1)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x & np.uint64(0x7FFFFFFF)).astype(np.uint32)


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    if not path.exists():
        raise BenchInputError(f"trace {path}: no such file")
    if path.is_dir():
        raise BenchInputError(f"trace {path}: is a directory")
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BenchInputError(f"trace {path}:{n}: not valid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise BenchInputError(f"trace {path}:{n}: expected a JSON object, got {type(obj).__name__}")
            yield n, obj


def _ids(path: Path, n: int, obj: dict[str, Any], field: str) -> np.ndarray:
    v = obj.get(field, [])
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise BenchInputError(f"trace {path}:{n}: '{field}' must be a list of integer token ids")
    if any(t < 0 or t >= 1 << 32 for t in v):
        raise BenchInputError(f"trace {path}:{n}: '{field}' holds ids outside [0, 2**32)")
    return np.asarray(v, dtype=np.uint32)


def _timestamp(path: Path, n: int, obj: dict[str, Any], scale: float) -> float:
    t = obj.get("timestamp", 0)
    if not isinstance(t, int | float) or isinstance(t, bool):
        raise BenchInputError(f"trace {path}:{n}: 'timestamp' must be a number")
    try:
        ts = float(t) * scale
    except OverflowError:
        ts = math.inf
    if not math.isfinite(ts) or ts < 0:
        raise BenchInputError(f"trace {path}:{n}: 'timestamp' must be a finite number >= 0, got {t!r}")
    return ts


def _mooncake(path: Path, n: int, obj: dict[str, Any]) -> TraceRequest:
    hid, length = obj.get("hash_ids"), obj.get("input_length")
    if not isinstance(hid, list) or not hid or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 64 for h in hid):
        raise BenchInputError(f"trace {path}:{n}: 'hash_ids' must be a non-empty list of ids in [0, 2**64)")
    if (not isinstance(length, int) or isinstance(length, bool)
            or not MOONCAKE_BLOCK * (len(hid) - 1) < length <= MOONCAKE_BLOCK * len(hid)):
        raise BenchInputError(f"trace {path}:{n}: 'input_length' {length!r} does not fit {len(hid)} blocks "
                              f"of {MOONCAKE_BLOCK} tokens")
    tokens = block_tokens(np.asarray(hid, dtype=np.uint64))[:length]
    return TraceRequest(tokens, np.empty(0, np.uint32), _timestamp(path, n, obj, 1e-3), "", "mooncake")


def _own(path: Path, n: int, obj: dict[str, Any], tok: Tokenizer | None) -> TraceRequest:
    session = str(obj.get("session", ""))
    ts = _timestamp(path, n, obj, 1.0)
    if "tokens" in obj:
        return TraceRequest(_ids(path, n, obj, "tokens"), _ids(path, n, obj, "output"), ts, session, "jsonl")
    text = obj.get("prompt", obj.get("text"))
    if not isinstance(text, str):
        if "hash_ids" in obj:  # only when read with --format jsonl: auto would have read it as Mooncake
            raise BenchInputError(f"trace {path}:{n}: a Mooncake line (hash_ids) read as --format jsonl")
        raise BenchInputError(f"trace {path}:{n}: needs 'tokens' (ids), 'prompt' (text) or 'hash_ids' (Mooncake)")
    tk = tok or WordTokenizer()
    out = obj.get("output_text", "")
    tokens = np.asarray(tk.encode(text), dtype=np.uint32)
    output = np.asarray(tk.encode(out) if isinstance(out, str) and out else [], dtype=np.uint32)
    return TraceRequest(tokens, output, ts, session, "text")


# fields only the own format has (a request's ids or its text)
_OWN_FIELDS = ("tokens", "prompt", "text")
_FORMAT_NAMES = {"mooncake": "Mooncake (hash_ids)", "jsonl": "own JSONL (tokens/prompt)"}


def _detect(path: Path, n: int, obj: dict[str, Any]) -> str:
    """The format of one line read with ``fmt="auto"``: ``mooncake`` when it has ``hash_ids``, else
    ``jsonl``; a line with both ``hash_ids`` and an own-format field is an error."""
    if "hash_ids" not in obj:
        return "jsonl"
    own = [f for f in _OWN_FIELDS if f in obj]
    if own:
        raise BenchInputError(f"trace {path}:{n}: has both 'hash_ids' (Mooncake) and '{own[0]}' (own JSONL); "
                              f"pass --format mooncake or --format jsonl")
    return "mooncake"


def load_trace(path: str | Path, fmt: str = "auto", tokenizer: Tokenizer | None = None,
               limit: int | None = None) -> list[TraceRequest]:
    """Read a trace (first ``limit`` requests); ``fmt`` auto-detects Mooncake by its ``hash_ids`` field.

    Requests are returned in file order with timestamps relative to the first one. With ``fmt="auto"``
    the first request's format is the file's: a later line in the other one is a :class:`BenchInputError`
    naming the file, that line and the first.
    """
    if fmt not in FORMATS:
        raise BenchInputError(f"--format: unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    p = Path(path)
    out: list[TraceRequest] = []
    first: tuple[int, str] | None = None  # (line, format) of the first request, with fmt="auto"
    for n, obj in _lines(p):
        kind = fmt
        if fmt == "auto":
            kind = _detect(p, n, obj)
            if first is None:
                first = (n, kind)
            elif kind != first[1]:
                raise BenchInputError(f"trace {p}:{n}: the format changes here: this line is "
                                      f"{_FORMAT_NAMES[kind]}, the first request (line {first[0]}) is "
                                      f"{_FORMAT_NAMES[first[1]]}; a trace holds one format")
        out.append(_mooncake(p, n, obj) if kind == "mooncake" else _own(p, n, obj, tokenizer))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise BenchInputError(f"trace {p}: no requests")
    t0 = out[0].timestamp
    for r in out:
        r.timestamp -= t0
    return out


def is_mooncake(requests: list[TraceRequest]) -> bool:
    return bool(requests) and requests[0].kind == "mooncake"
