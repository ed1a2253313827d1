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

Generated traces (:func:`generated_trace`) are Mooncake-shaped -- every request a chain of block ids, the
blocks it shares with earlier requests first -- drawn from a law (:class:`TraceLaw`) whose parameters come
from a seed within one of :data:`TRACE_KINDS`: multi-turn chat (short or long think times), agents
appending tool outputs, RAG over documents of skewed or flat popularity, one-off prompts beside RAG,
RAG whose popular documents drift, and a mix. They hold no text, only the shape of the reuse; the policy
evaluation (``benchmarks/policy_eval.py``) replays them with blocks of ``GENERATED_BLOCK`` tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
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


# ---------------------------------------------------------------------------------------- generated traces
TRACE_KINDS = ("chat", "chat-think", "agent", "rag", "rag-flat", "oneoff", "drift", "mixed")
GENERATED_BLOCK = 16  # tokens per block of a generated trace (hit rates depend on blocks, not on tokens)


@dataclass(frozen=True)
class TraceLaw:
    """How a generated trace's sessions arrive and what they send. Sizes are in blocks; times in request
    slots (the trace's requests arrive one per slot on average)."""

    kind: str
    mix: tuple[float, float, float, float] = (1.0, 0.0, 0.0, 0.0)  # session shares: chat, rag, agent, one-off
    n_sys: int = 4  # system prompts (the shared prefix every session starts with; one-offs half the time)
    sys_blocks: tuple[int, int] = (1, 3)  # a system prompt's length, uniform in the range
    sys_skew: float = 1.0  # Zipf exponent of the system prompts' popularity
    turns: float = 5.0  # chat: mean turns of a conversation that is not a single turn
    single: float = 0.3  # chat: share of one-turn conversations
    msg_blocks: tuple[int, int] = (1, 4)  # chat: blocks a turn adds (message and the previous answer)
    think: float = 50.0  # chat: mean slots between two turns of a conversation (exponential)
    n_docs: int = 200  # rag: document sets
    doc_blocks: tuple[int, int] = (4, 16)
    doc_skew: float = 1.0  # rag: Zipf exponent of the documents' popularity
    visit_q: float = 2.0  # rag: mean questions a visit asks in a row (geometric)
    steps: float = 10.0  # agent: mean steps (geometric); each appends a tool output
    tool_blocks: tuple[int, int] = (2, 8)
    step_think: float = 5.0  # agent steps and a visit's questions: mean slots between two requests
    oneoff_blocks: tuple[int, int] = (2, 20)
    drift: float = 0.0  # rag: the popularity ranking of documents moves this many places per 1000 slots


def draw_law(kind: str, seed: int) -> TraceLaw:
    """The law of trace ``kind`` for ``seed``: its parameters drawn from the ranges of that kind."""
    if kind not in TRACE_KINDS:
        raise BenchInputError(f"unknown generated trace kind {kind!r}; known: {', '.join(TRACE_KINDS)}")
    rng = np.random.default_rng([seed, 104729, TRACE_KINDS.index(kind)])

    def u(a: float, b: float) -> float:
        return float(rng.uniform(a, b))

    def lu(a: float, b: float) -> float:
        return float(math.exp(rng.uniform(math.log(a), math.log(b))))

    def ri(a: int, b: int) -> int:
        return int(rng.integers(a, b + 1))

    sys_ = {"n_sys": ri(1, 20), "sys_blocks": (1, ri(1, 12)), "sys_skew": u(0.5, 1.5)}
    chat = {"turns": u(2, 10), "single": u(0.1, 0.7), "msg_blocks": (1, ri(2, 12))}
    rag = {"n_docs": int(lu(50, 2000)), "doc_skew": u(0.5, 1.4), "visit_q": u(1, 5), "doc_blocks": (2, ri(4, 20))}
    if kind in ("chat", "chat-think"):
        think = lu(5, 100) if kind == "chat" else lu(200, 2000)
        return TraceLaw(kind, think=think, **sys_, **chat)  # type: ignore[arg-type]
    if kind == "agent":
        return TraceLaw(kind, mix=(0, 0, 1, 0), steps=u(4, 20), tool_blocks=(1, ri(2, 12)), step_think=lu(2, 100),
                        **sys_, msg_blocks=(1, ri(2, 6)))  # type: ignore[arg-type]
    if kind in ("rag", "rag-flat"):
        if kind == "rag-flat":
            rag.update(n_docs=int(lu(500, 4000)), doc_skew=u(0.3, 0.8))
        return TraceLaw(kind, mix=(0, 1, 0, 0), step_think=lu(1, 50), **sys_, **rag)  # type: ignore[arg-type]
    if kind == "oneoff":
        o = u(0.3, 0.8)
        return TraceLaw(kind, mix=(0, 1 - o, 0, o), oneoff_blocks=(1, ri(4, 30)), **sys_, **rag)  # type: ignore[arg-type]
    if kind == "drift":
        return TraceLaw(kind, mix=(u(0, 0.5), 1, 0, 0), drift=u(20, 300), think=lu(10, 500),
                        **sys_, **rag, **chat)  # type: ignore[arg-type]
    w = rng.dirichlet(np.ones(4))
    return TraceLaw(kind, mix=(float(w[0]), float(w[1]), float(w[2]), float(w[3])), think=lu(10, 1000),
                    steps=u(4, 20), tool_blocks=(1, ri(2, 12)), step_think=lu(2, 100),
                    **sys_, **chat, **rag)  # type: ignore[arg-type]


def _zipf(n: int, a: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** a
    return np.asarray(w / w.sum())


def law_blocks(law: TraceLaw, requests: int, seed: int) -> list[tuple[float, list[int]]]:
    """``requests`` requests of ``law`` as (arrival slot, block ids), in arrival order (deterministic by seed)."""
    rng = np.random.default_rng([seed, 7919])
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    def size(r: tuple[int, int]) -> int:
        return int(rng.integers(r[0], r[1] + 1))

    systems = [fresh(size(law.sys_blocks)) for _ in range(law.n_sys)]
    sys_p = _zipf(law.n_sys, law.sys_skew)
    docs = [fresh(size(law.doc_blocks)) for _ in range(law.n_docs)]
    doc_p = _zipf(law.n_docs, law.doc_skew)
    mix = np.asarray(law.mix, dtype=float)
    mix /= mix.sum()
    per_session = np.array([1 + (1 - law.single) * (law.turns - 1), law.visit_q, law.steps, 1.0])
    rate = 1.0 / float((mix * per_session).sum())  # sessions per slot
    events: list[tuple[float, int, list[int]]] = []
    t = 0.0
    while t < requests:
        t += float(rng.exponential(1.0 / rate))
        kind = int(rng.choice(4, p=mix))
        head = systems[int(rng.choice(law.n_sys, p=sys_p))]
        when = t
        if kind == 0:  # a conversation: each turn extends the previous prompt
            n = 1 if rng.random() < law.single else 1 + int(rng.geometric(1.0 / max(law.turns - 1, 1.0)))
            hist = list(head)
            for _ in range(n):
                hist = hist + fresh(size(law.msg_blocks))
                events.append((when, len(events), hist))
                when += float(rng.exponential(law.think))
        elif kind == 1:  # a RAG visit: questions about one document set
            d = (int(rng.choice(law.n_docs, p=doc_p)) + int(law.drift * t / 1000.0)) % law.n_docs
            base = head + docs[d]
            for _ in range(int(rng.geometric(1.0 / law.visit_q))):
                events.append((when, len(events), base + fresh(1)))
                when += float(rng.exponential(law.step_think))
        elif kind == 2:  # an agent: every step appends a tool output
            hist = list(head) + fresh(size(law.msg_blocks))
            for _ in range(int(rng.geometric(1.0 / law.steps))):
                events.append((when, len(events), hist))
                hist = hist + fresh(size(law.tool_blocks))
                when += float(rng.exponential(law.step_think))
        else:  # a one-off prompt, under a system prompt half the time
            alone = rng.random() < 0.5
            body = fresh(size(law.oneoff_blocks))
            events.append((when, len(events), body if alone else head + body))
    events.sort(key=lambda e: (e[0], e[1]))
    return [(w, ids) for w, _, ids in events[:requests]]


def generated_trace(kind: str, seed: int, requests: int = 2000, block: int = GENERATED_BLOCK) -> list[TraceRequest]:
    """A generated trace of ``kind`` (law drawn from ``seed``), blocks of ``block`` tokens as in a Mooncake
    trace (:func:`block_tokens`); no outputs."""
    law = draw_law(kind, seed)
    return [TraceRequest(block_tokens(np.asarray(ids, dtype=np.uint64), block), timestamp=w, kind=f"law:{kind}")
            for w, ids in law_blocks(law, requests, seed)]
