"""Three workloads that live on prefix reuse (RAG, few-shot, multi-turn chat) and a mix, as request
streams deterministic by seed.

* ``rag`` -- multi-query RAG: a system prompt, one of many retrieved document sets (popularity is
  Zipf-like; users ask a few questions in a row about one set), a question.
* ``fewshot`` -- few-shot classification: a handful of tasks, each a fixed instruction + example block,
  then the text to classify; outputs are a few tokens.
* ``multiturn`` -- multi-turn chat: interleaved conversations; each turn's prompt is the previous prompt,
  the previous answer and a new user message.
* ``mixed`` -- the three merged by arrival time.

``volatile`` plants what most often breaks prefix reuse at the very start of every prompt: ``timestamp``
(the previous request's arrival time, to the second), ``session`` (a per-conversation id) or
``request_id`` (a fresh id per request). Arrivals of each workload are Poisson at ``rate`` requests per
second; ``mixed`` merges three such streams (about 3 x ``rate``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hicache.bench.errors import BenchInputError
from hicache.bench.tokenizer import OPAQUE_BASE, WordTokenizer

WORKLOADS = ("rag", "fewshot", "multiturn", "mixed")
VOLATILE = ("timestamp", "session", "request_id")
_VOCAB = 32000
_EPOCH = dt.datetime(2026, 12, 2, 9, 0, 0)
# multiturn's law: a conversation runs a uniform number of turns in MULTITURN_TURNS; one joins whenever fewer
# than MULTITURN_MIN_ACTIVE are open, else with probability MULTITURN_JOIN per request; each request continues
# an open conversation chosen uniformly
MULTITURN_TURNS = (2, 12)
MULTITURN_MIN_ACTIVE = 8
MULTITURN_JOIN = 0.15


@dataclass
class TraceRequest:
    """One request of a trace or workload."""

    tokens: np.ndarray  # prompt token ids, uint32
    output: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint32))  # generated ids (cached after)
    timestamp: float = 0.0  # seconds since the start of the trace
    session: str = ""  # conversation / user id, if known
    kind: str = ""  # workload name, or 'jsonl' / 'text' / 'mooncake' for trace lines

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "mixed"
    requests: int = 600
    seed: int = 0
    rate: float = 8.0  # requests per second
    volatile: str | None = None
    scale: float = 1.0  # multiplies every generated span (documents, examples, messages, questions, outputs)

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise BenchInputError(f"--workload: unknown workload {self.name!r}; known: {', '.join(WORKLOADS)}")
        if self.volatile is not None and self.volatile not in VOLATILE:
            raise BenchInputError(f"--plant: unknown span {self.volatile!r}; known: {', '.join(VOLATILE)}")
        if self.requests < 1:
            raise BenchInputError(f"--requests: must be >= 1, got {self.requests}")
        if self.rate <= 0 or self.scale <= 0:
            raise BenchInputError("--rate and --scale must be > 0")


class _Gen:
    """Shared helpers: one RNG, one tokenizer, opaque content, volatile prefixes."""

    def __init__(self, spec: WorkloadSpec, tok: WordTokenizer, salt: int) -> None:
        self.spec = spec
        self.rng = np.random.default_rng([spec.seed, salt])
        self.tok = tok
        self.t = 0.0
        self.n = 0

    def text(self, s: str) -> np.ndarray:
        return self.tok.encode_np(s)

    def opaque(self, n: int) -> np.ndarray:
        """``n`` tokens of document-like content (ids the word tokenizer never produces)."""
        return (OPAQUE_BASE + self.rng.integers(0, _VOCAB, max(int(n * self.spec.scale), 1))).astype(np.uint32)

    def length(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def tick(self) -> float:
        self.t += float(self.rng.exponential(1.0 / self.spec.rate))
        return self.t

    def volatile(self, session: str) -> np.ndarray:
        v = self.spec.volatile
        self.n += 1
        if v is None:
            return np.empty(0, np.uint32)
        if v == "timestamp":
            when = _EPOCH + dt.timedelta(seconds=self.t)
            return self.text(f"Current time: {when:%Y-%m-%d %H:%M:%S}\n")
        if v == "session":
            return self.text(f"Session id: {session}\n")
        return self.text(f"Request id: {self.rng.integers(1 << 62):016x}\n")

    def uid(self) -> str:
        return f"{self.rng.integers(1 << 62):016x}"


def _cat(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts).astype(np.uint32, copy=False)


def _zipf_choice(rng: np.random.Generator, n: int, a: float = 1.1) -> int:
    w = 1.0 / np.arange(1, n + 1) ** a
    return int(rng.choice(n, p=w / w.sum()))


def rag(spec: WorkloadSpec, tok: WordTokenizer, count: int | None = None) -> list[TraceRequest]:
    g = _Gen(spec, tok, 1)
    n = count or spec.requests
    system = g.text("You are a document question answering assistant. Answer only from the reference "
                    "documents and cite the article numbers you used.\n")
    sets = [g.opaque(g.length(1200, 3000)) for _ in range(max(8, n // 12))]
    out: list[TraceRequest] = []
    while len(out) < n:
        s = _zipf_choice(g.rng, len(sets))
        user = g.uid()
        for _ in range(g.length(1, 5)):
            if len(out) >= n:
                break
            q = _cat(g.text("\nQuestion: "), g.opaque(g.length(12, 60)), g.text("\nAnswer:"))
            prompt = _cat(g.volatile(user), system, g.text("Reference documents:\n"), sets[s], q)
            out.append(TraceRequest(prompt, g.opaque(g.length(40, 200)), g.tick(), user, "rag"))
    return out


def fewshot(spec: WorkloadSpec, tok: WordTokenizer, count: int | None = None) -> list[TraceRequest]:
    g = _Gen(spec, tok, 2)
    n = count or spec.requests
    tasks = []
    for t in range(6):
        head = g.text(f"Classify the document into one of the categories of task {t}: contract, report, "
                      "email, other.\nExamples:\n")
        examples = [_cat(g.text("Document: "), g.opaque(g.length(60, 250)), g.text(" -> category\n"))
                    for _ in range(g.length(6, 16))]
        tasks.append(_cat(head, *examples))
    out: list[TraceRequest] = []
    for _ in range(n):
        t = _zipf_choice(g.rng, len(tasks), 0.8)
        user = g.uid()
        prompt = _cat(g.volatile(user), tasks[t], g.text("Document to classify:\n"),
                      g.opaque(g.length(40, 400)), g.text("\nCategory:"))
        out.append(TraceRequest(prompt, g.opaque(g.length(1, 6)), g.tick(), user, "fewshot"))
    return out


def multiturn(spec: WorkloadSpec, tok: WordTokenizer, count: int | None = None) -> list[TraceRequest]:
    g = _Gen(spec, tok, 3)
    n = count or spec.requests
    system = g.text("You are a friendly customer support assistant for an online store. Be concise.\n")
    active: list[dict[str, object]] = []
    out: list[TraceRequest] = []
    while len(out) < n:
        if len(active) < MULTITURN_MIN_ACTIVE or g.rng.random() < MULTITURN_JOIN:
            active.append({"id": g.uid(), "history": np.empty(0, np.uint32), "turns": g.length(*MULTITURN_TURNS)})
        i = int(g.rng.integers(len(active)))
        conv = active[i]
        sid = str(conv["id"])
        history = conv["history"]
        assert isinstance(history, np.ndarray)
        msg = _cat(g.text("\nUser: "), g.opaque(g.length(15, 120)), g.text("\nAssistant:"))
        prompt = _cat(g.volatile(sid), system, history, msg)
        answer = g.opaque(g.length(40, 250))
        out.append(TraceRequest(prompt, answer, g.tick(), sid, "multiturn"))
        conv["history"] = _cat(history, msg, answer)
        conv["turns"] = int(conv["turns"]) - 1  # type: ignore[call-overload]
        if int(conv["turns"]) <= 0:  # type: ignore[call-overload]
            active.pop(i)
    return out


def mixed(spec: WorkloadSpec, tok: WordTokenizer, count: int | None = None) -> list[TraceRequest]:
    n = count or spec.requests
    parts = [f(spec, tok, max(1, n // 3 + (1 if k < n % 3 else 0)))
             for k, f in enumerate((rag, fewshot, multiturn))]
    merged = sorted((r for p in parts for r in p), key=lambda r: r.timestamp)
    return merged[:n]


_BUILDERS: dict[str, Callable[[WorkloadSpec, WordTokenizer, int | None], list[TraceRequest]]] = {
    "rag": rag, "fewshot": fewshot, "multiturn": multiturn, "mixed": mixed,
}


def generate(spec: WorkloadSpec, tok: WordTokenizer | None = None) -> list[TraceRequest]:
    """The requests of ``spec`` (same spec and seed -> the same token ids, outputs and timestamps)."""
    return _BUILDERS[spec.name](spec, tok or WordTokenizer(), None)
