"""Prompt-structure doctor: what in the prompts breaks prefix reuse, and what fixing it would buy.

1. Replay the prompts in order; for each request find the earlier prompt sharing its longest token
   prefix (the *nearest*) and the position where they diverge.
2. If the two prompts re-synchronise shortly after (a run of ``resync`` equal tokens within
   ``max_span`` tokens), the request's tokens in between are a *volatile span*: something small that
   changes per request (a timestamp, an id, a name) in front of content that would otherwise be reused.
   Spans over text are widened to whole date/number/id tokens and classified by regex.
3. Spans are grouped by the tokens just after them (where the prompts re-synchronise) and their kind.
4. The fix is simulated group by group, the groups that lose most tokens first (at most ``max_groups``):
   in every prompt, the group's span is moved to the end, and the move is kept if it raises the hit rate
   at infinite capacity. Hit rates before and after are compared (infinite capacity and the given L1
   capacity).

Advice follows the 60% rule of prefix caching: under 60% fix the prompt structure; above 60% with little gain from
the fix, add tiers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache.bench.optimal import infinite, page_trace
from hicache.bench.tokenizer import WordTokenizer
from hicache.bench.workloads import TraceRequest

if TYPE_CHECKING:
    from rich.console import Console

THRESHOLD = 0.60
_HEXLIKE = re.compile(r"^[0-9A-Fa-f]+$")
_SEP = {"-", ":", "/", ".", "T", "Z", "+", "_"}
KINDS: list[tuple[str, re.Pattern[str]]] = [
    ("timestamp", re.compile(r"\d{4}-\d{1,2}-\d{1,2}|\d{1,2}:\d{2}(:\d{2})?|\d{1,2}/\d{1,2}/\d{2,4}")),
    ("uuid", re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")),
    ("hex id", re.compile(r"^(?=.*[0-9])(?=.*[a-fA-F])[0-9a-fA-F]{8,}$")),
    ("number / numeric id", re.compile(r"^[0-9][0-9\-_.]*$")),
    ("name", re.compile(r"^([A-Z][a-z]+)( [A-Z][a-z]+)*$")),
]


def classify(text: str) -> str:
    """Kind of a diverging span from its text (``opaque tokens`` when there is no text)."""
    if not text or ("<" in text and ">" in text and not re.search(r"[A-Za-z]{2,}", re.sub(r"<\d+>", "", text))):
        return "opaque tokens"
    compact = re.sub(r"\s+(?=[-:/.])|(?<=[-:/.])\s+", "", text.strip())
    dense = compact.replace(" ", "")
    for kind, rx in KINDS:
        if kind == "name":
            if rx.match(compact):
                return kind
        elif rx.search(dense if kind != "timestamp" else compact) or rx.search(dense):
            return kind
    return "other"


@dataclass
class SpanGroup:
    """Volatile spans with the same right anchor and kind: the same field in every prompt."""

    right: tuple[int, ...]  # tokens just after the span (up to 3): where the prompts re-synchronise
    kind: str
    lefts: dict[tuple[int, ...], int] = field(default_factory=dict)  # tokens just before it -> times seen
    max_len: int = 0  # longest span seen (a span may start late when ids share leading digits by chance)
    min_end: int = 1 << 62  # earliest token offset of its end
    count: int = 0  # requests where it broke reuse
    tokens_lost: int = 0  # tokens after it that would have matched the nearest prompt
    positions: list[int] = field(default_factory=list)  # token offset of the span in each request
    examples: list[str] = field(default_factory=list)  # up to 3 span texts (or ids)
    context: str = ""  # anchors + first span, as text

    @property
    def median_position(self) -> int:
        return int(np.median(self.positions)) if self.positions else 0


@dataclass
class DoctorReport:
    requests: int
    misses_diverging: int  # requests whose miss re-synchronises with an earlier prompt
    misses_new_content: int  # requests that simply continue with content never seen
    groups: list[SpanGroup]  # groups whose move to the end helps, most tokens lost first
    rejected: list[SpanGroup]  # found, not kept: moving them did not help (e.g. a per-conversation id), or
    # beyond max_groups (not tried)
    before_infinite: float
    after_infinite: float
    before_capacity: float | None  # at the L1 capacity with the eviction policy (None: not run)
    after_capacity: float | None
    capacity_tokens: int | None
    advice: str

    def to_dict(self) -> dict[str, object]:
        d = dict(vars(self))
        for key in ("groups", "rejected"):
            d[key] = [{"kind": g.kind, "count": g.count, "tokens_lost": g.tokens_lost, "context": g.context,
                       "examples": g.examples, "median_position": g.median_position, "right": list(g.right)}
                      for g in getattr(self, key)]
        return d


class _Trie:
    """Token trie over the first ``depth`` tokens; each node remembers the last request through it."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root: dict[int, list[object]] = {}

    def add(self, toks: np.ndarray, r: int) -> None:
        node = self.root
        for t in toks[: self.depth].tolist():
            e = node.get(t)
            if e is None:
                e = node[t] = [{}, r]
            e[1] = r
            node = e[0]  # type: ignore[assignment]

    def nearest(self, toks: np.ndarray) -> tuple[int, int]:
        """(length of the longest shared prefix within ``depth``, last request sharing it); (0, -1) if none."""
        node, best, n = self.root, -1, 0
        for t in toks[: self.depth].tolist():
            e = node.get(t)
            if e is None:
                break
            best = e[1]  # type: ignore[assignment]
            n += 1
            node = e[0]  # type: ignore[assignment]
        return n, best


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


def _find(hay: np.ndarray, needle: np.ndarray, start: int = 0, stop: int | None = None) -> int:
    """First index >= start where ``needle`` occurs in ``hay`` (and starts before ``stop``); -1 if none."""
    hb, nb = hay.astype("<u4", copy=False).tobytes(), needle.astype("<u4", copy=False).tobytes()
    pos = start * 4
    end = len(hb) if stop is None else min(len(hb), (stop + len(needle)) * 4)
    while True:
        i = hb.find(nb, pos, end)
        if i < 0:
            return -1
        if i % 4 == 0:
            return i // 4
        pos = i + 1


class Doctor:
    def __init__(self, token_text: Callable[[int], str] | None = None, page_size: int = 16,
                 max_span: int = 64, resync: int = 8, min_count: int = 2) -> None:
        self.token_text = token_text
        self.page_size = page_size
        self.max_span = max_span
        self.resync = resync
        self.min_count = min_count

    # ------------------------------------------------------------------ detection
    def _text(self, toks: np.ndarray) -> str:
        if self.token_text is None:
            return " ".join(f"<{int(t)}>" for t in toks)
        words = [self.token_text(int(t)) for t in toks]
        out = ""
        for w in words:
            out += w if (not out or w in _SEP or out[-1] in _SEP or w == "\n" or out.endswith("\n")) else " " + w
        return out

    def _widen(self, toks: np.ndarray, a: int, b: int) -> tuple[int, int]:
        """Grow [a, b) over neighbouring date/number/hex tokens so a span is a whole field."""
        if self.token_text is None:
            return a, b
        tt = self.token_text

        def fieldish(i: int) -> bool:
            w = tt(int(toks[i]))
            return bool(_HEXLIKE.match(w)) or w in _SEP

        while a > 0 and fieldish(a - 1):
            a -= 1
        while b < len(toks) and fieldish(b):
            b += 1
        while a < b and tt(int(toks[a])) in _SEP:
            a += 1
        return a, b

    def _align(self, r: np.ndarray, n: np.ndarray, d: int) -> tuple[int, int] | None:
        """Smallest (a, b): r[d+a:] re-synchronises with n[d+b:] for ``resync`` tokens."""
        R = self.resync
        for a in range(0, self.max_span + 1):
            w = r[d + a: d + a + R]
            if len(w) < R:
                return None
            b = _find(n, w, d, d + self.max_span)
            if b >= 0:
                return a, b - d
        return None

    def diagnose(self, requests: Sequence[TraceRequest]) -> tuple[list[SpanGroup], int, int]:
        trie = _Trie(128)  # divergence past it is located through page ids
        prompts = [r.tokens for r in requests]
        last_with_page: dict[int, int] = {}
        pt = page_trace(requests, self.page_size)
        groups: dict[tuple[tuple[int, ...], str], SpanGroup] = {}  # by (right anchor, kind)
        diverging = new_content = 0
        for i, r in enumerate(prompts):
            k, near = trie.nearest(r)
            if k >= trie.depth:  # shares beyond the trie: nearest by page ids
                pages = pt.prompt[i]
                j = 0
                while j < len(pages) and pages[j] in last_with_page:
                    j += 1
                if j:
                    near = last_with_page[pages[j - 1]]
            if near >= 0:
                n = prompts[near]
                d = _lcp(r, n)
                if d < len(r) and d < len(n):
                    al = self._align(r, n, d)
                    if al is None:
                        new_content += 1
                    else:
                        diverging += 1
                        a, b = al
                        s, e = self._widen(r, d, d + a) if a else (d, d)
                        left = tuple(int(x) for x in r[max(0, s - 3): s])
                        right = tuple(int(x) for x in r[e: e + 3])
                        span_text = self._text(r[s:e]) if e > s else self._text(n[d: d + b])
                        kind = classify(span_text)
                        g = groups.get((right, kind))
                        if g is None:
                            g = groups[(right, kind)] = SpanGroup(right, kind)
                            g.context = (self._text(r[max(0, s - 3): s]) + " [" + span_text + "] "
                                         + self._text(r[e: e + 3]))
                        g.lefts[left] = g.lefts.get(left, 0) + 1
                        g.max_len = max(g.max_len, e - s)
                        g.min_end = min(g.min_end, e)
                        g.count += 1
                        g.tokens_lost += _lcp(r[d + a:], n[d + b:])
                        g.positions.append(s)
                        if len(g.examples) < 3:
                            g.examples.append(self._text(r[s:e]))
            trie.add(r, i)
            for p in pt.prompt[i]:
                last_with_page[p] = i
        kept = sorted((g for g in groups.values() if g.count >= self.min_count), key=lambda g: -g.tokens_lost)
        return kept, diverging, new_content

    # ------------------------------------------------------------------ fix simulation
    def _span(self, toks: np.ndarray, g: SpanGroup) -> tuple[int, int] | None:
        """Where ``g``'s span lies in ``toks``: it ends at the right anchor and starts after the earliest of the
        left anchors seen (else ``max_len`` tokens before the end)."""
        if not g.right or not g.max_len:
            return None
        e = _find(toks, np.asarray(g.right, dtype=np.uint32), max(0, g.min_end - g.max_len))
        if e < 0:
            return None
        s = max(0, e - g.max_len)
        starts = []
        for left in g.lefts:
            at = _find(toks, np.asarray(left, dtype=np.uint32), max(0, s - len(left)), e) if left else -1
            if at >= 0 and at + len(left) <= e:
                starts.append(at + len(left))
        if starts:
            s = min(starts)  # the widest span: some anchors end inside the field (ids sharing leading digits)
        return (s, e) if e > s else None

    def fix(self, requests: Sequence[TraceRequest], groups: Sequence[SpanGroup]) -> list[TraceRequest]:
        """The requests with every group's span moved to the end of the prompt."""
        out = []
        for req in requests:
            toks = req.tokens
            moved: list[np.ndarray] = []
            for g in groups:
                span = self._span(toks, g)
                if span is not None:
                    s, e = span
                    moved.append(toks[s:e].copy())
                    toks = np.concatenate([toks[:s], toks[e:]])
            if moved:
                toks = np.concatenate([toks, *moved]).astype(np.uint32)
            out.append(TraceRequest(toks, req.output, req.timestamp, req.session, req.kind))
        return out


def advise(before: float, after: float, groups: Sequence[SpanGroup], infinite_after: float | None = None) -> str:
    """The 60% rule. ``before``/``after``: hit rates without / with the simulated fix (at the L1
    capacity when known); ``infinite_after``: the fixed prompts' infinite-capacity bound."""
    gain = after - before
    top = ", ".join(f"{g.kind} at token ~{g.median_position} ({g.context.strip()!r})" for g in groups[:3])
    bound = after if infinite_after is None else infinite_after
    if before < THRESHOLD:
        if groups and gain > 0.02:
            return (f"Hit rate {before:.0%} is under {THRESHOLD:.0%}: fix the prompt structure. Move the volatile "
                    f"part(s) to the end of the prompt -- {top} -- simulated hit rate {before:.0%} -> {after:.0%}.")
        if bound >= THRESHOLD:
            return (f"Hit rate {before:.0%} is under {THRESHOLD:.0%}, but the prompt structure is fine: unlimited "
                    f"capacity would hit {bound:.0%}. Capacity is the limit -- add tiers (L2 host memory, L3 store).")
        return (f"Hit rate {before:.0%} is under {THRESHOLD:.0%} and no volatile span explains it: the prompts "
                "share little prefix; put shared content (system prompt, documents, examples) first.")
    if gain < 0.05:
        return (f"Hit rate {before:.0%} is above {THRESHOLD:.0%} and fixing the prompts gains only {gain:+.0%}: "
                "the structure is fine -- add tiers (L2 host memory, L3 store) to keep more of the working set.")
    return (f"Hit rate {before:.0%} is above {THRESHOLD:.0%}, but moving {top} to the end would reach {after:.0%}: "
            "worth fixing before adding tiers.")


def run_doctor(requests: Sequence[TraceRequest], page_size: int, token_text: Callable[[int], str] | None = None,
               capacity_tokens: int | None = None, policy: str = "lru", max_groups: int = 6) -> DoctorReport:
    """Diagnose, simulate the fix, and advise. ``capacity_tokens``: also compare at that L1 capacity."""
    doc = Doctor(token_text, page_size)
    found, diverging, new = doc.diagnose(requests)
    before_inf = infinite(page_trace(requests, page_size)).hit_rate
    # keep a group's fix only if it helps (a per-conversation id moved behind the history hurts)
    groups: list[SpanGroup] = []
    fixed, after_inf = list(requests), before_inf
    for g in found[:max_groups]:
        trial = doc.fix(requests, [*groups, g])
        rate = infinite(page_trace(trial, page_size)).hit_rate
        if rate > after_inf + 1e-9:
            groups.append(g)
            fixed, after_inf = trial, rate
    before_cap = after_cap = None
    if capacity_tokens:
        from hicache.bench.run import policy_hit_rate

        before_cap = policy_hit_rate(requests, page_size, capacity_tokens, policy)
        after_cap = policy_hit_rate(fixed, page_size, capacity_tokens, policy)
    b = before_cap if before_cap is not None else before_inf
    a = after_cap if after_cap is not None else after_inf
    rejected = [g for g in found if g not in groups]
    return DoctorReport(len(requests), diverging, new, groups, rejected, before_inf, after_inf, before_cap, after_cap,
                        capacity_tokens, advise(b, a, groups, after_inf))


def render(rep: DoctorReport, console: Console) -> None:
    """The diagnosis as ``hicache doctor`` and ``hicache bench --doctor`` print it."""
    from rich.table import Table  # rich: only for the terminal report

    console.print(f"[bold]hicache doctor[/bold] -- {rep.requests} requests: {rep.misses_diverging} misses diverge "
                  f"from an earlier prompt and re-synchronise (volatile span), {rep.misses_new_content} continue "
                  "with new content")
    if rep.groups or rep.rejected:
        t = Table(title="Diverging spans (grouped by where the prompts re-synchronise)")
        for col in ("kind", "requests", "tokens lost", "at token", "before [span] after", "moving it to the end"):
            t.add_column(col, justify="right" if col in ("requests", "tokens lost", "at token") else "left")
        for g, verdict in [(g, "helps") for g in rep.groups] + [(g, "does not help") for g in rep.rejected[:5]]:
            t.add_row(g.kind, str(g.count), str(g.tokens_lost), str(g.median_position), g.context.replace("\n", "\\n"),
                      verdict)
        console.print(t)
    console.print(f"hit rate with infinite capacity: {rep.before_infinite:.1%} -> {rep.after_infinite:.1%} "
                  "after the simulated fix")
    if rep.before_capacity is not None and rep.after_capacity is not None:
        console.print(f"hit rate at L1 {rep.capacity_tokens} tokens: {rep.before_capacity:.1%} -> "
                      f"{rep.after_capacity:.1%}")
    console.print(f"[bold]advice:[/bold] {rep.advice}")


def diagnose_and_render(wl: Any, capacity_tokens: int | None, policy: str, console: Console) -> DoctorReport:
    """:func:`run_doctor` on a loaded workload (``hicache.bench.run.load_requests``), printed."""
    tok = wl.tokenizer
    token_text = tok.token_text if isinstance(tok, WordTokenizer) else (lambda i: tok.decode([i]))
    rep = run_doctor(wl.requests, wl.page_size, token_text, capacity_tokens, policy)
    render(rep, console)
    return rep
