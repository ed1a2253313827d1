"""Render a :class:`~hicache.bench.run.BenchResult`: rich tables on the terminal, JSON and CSV files."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hicache.bench.run import BenchResult
from hicache.bench.units import human_bytes, human_tokens

ADVICE_THRESHOLD = 0.60  # the 60% rule: under it even at unlimited capacity, fix the prompt;
# under it only at this capacity, or over it with room left, add tiers


def advice(hit_rate: float, infinite: float) -> str:
    """One line of advice by the 60% rule: a prompt structure that shares little prefix is fixed in the
    prompts, not with more capacity; a good structure short of its bound wants more capacity (tiers)."""
    if infinite < ADVICE_THRESHOLD:
        return (f"Even unlimited capacity would hit only {infinite:.0%}: the prompts share little prefix. "
                "Fix the prompt structure (run `hicache doctor`): keep shared content first, volatile parts "
                "(timestamps, ids, names) last.")
    if hit_rate < ADVICE_THRESHOLD:
        return (f"Hit rate {hit_rate:.0%} is under {ADVICE_THRESHOLD:.0%} but unlimited capacity would reach "
                f"{infinite:.0%}: capacity is the limit -- add tiers (L2 host memory, L3 store) or grow them.")
    if infinite - hit_rate > 0.05:
        return (f"Hit rate {hit_rate:.0%} is above {ADVICE_THRESHOLD:.0%}; {infinite - hit_rate:.0%} more is "
                "reachable with more capacity: add or grow tiers.")
    if infinite < 0.8:
        return (f"Hit rate {hit_rate:.0%} is close to the {infinite:.0%} bound: capacity is not the limit, the "
                "prompts are -- run `hicache doctor` to see whether something volatile early in them breaks reuse.")
    return f"Hit rate {hit_rate:.0%} is close to the {infinite:.0%} bound: the cache is doing all it can."


def break_even(res: BenchResult) -> list[str]:
    """A line for each tier that served hits but loads a token's KV more slowly than the prefill would
    recompute it (at the assumed rates): hits there cost time instead of saving it."""
    out = []
    recompute_us = 1e6 / res.prefill_rate
    need = res.bytes_per_token * res.prefill_rate  # bytes/s at which loading a token takes as long as computing it
    for tier, bw, flag in (("l2", res.l2_bandwidth, "--l2-bandwidth"), ("l3", res.l3_bandwidth, "--l3-bandwidth")):
        if res.tiers[tier]["tokens"] <= 0 or bw >= need:
            continue
        load_us = 1e6 * res.bytes_per_token / bw
        out.append(f"{tier.upper()} hits cost time: loading a token's KV ({human_bytes(res.bytes_per_token)}) at "
                   f"{bw / 1e9:.1f} GB/s takes {load_us:.0f} us against {recompute_us:.0f} us to recompute it at "
                   f"{res.prefill_rate:,.0f} tokens/s; {tier.upper()} pays off above {need / 1e9:.1f} GB/s "
                   f"({flag}, --prefill-rate)")
    return out


def render(res: BenchResult, console: Console | None = None) -> None:
    c = console or Console()
    bpt = res.bytes_per_token
    c.print(f"[bold]hicache bench[/bold] -- {res.source}, {res.requests} requests, "
            f"{human_tokens(res.prompt_tokens)} prompt tokens, working set {human_tokens(res.working_set_tokens)} "
            f"tokens ({human_bytes(res.working_set_tokens * bpt)} of KV for {res.model_layout})")
    c.print(f"page {res.page_size} tokens | L1 {human_tokens(res.l1_tokens)} tokens "
            f"({human_bytes(res.l1_tokens * bpt)}) | L2 {human_tokens(res.l2_tokens)} tokens "
            f"({human_bytes(res.l2_tokens * bpt)}) | L3 {res.l3} | target {res.target} | "
            f"write {res.policies['write']}, eviction {res.policies['eviction']}, prefetch {res.policies['prefetch']}")
    t = Table(title="Hit rate by tier (prompt tokens; a request counts when it hit at least one page there)")
    for col in ("tier", "tokens hit", "token hit rate", "requests hitting"):
        t.add_column(col, justify="right")
    for name in ("l1", "l2", "l3", "total"):
        s = res.tiers[name]
        t.add_row(name.upper() if name != "total" else "[bold]total[/bold]", human_tokens(s["tokens"]),
                  f"{s['token_rate']:.1%}", f"{s['request_rate']:.1%}")
    c.print(t)
    saved, total = res.prefill_seconds_saved, res.prefill_seconds_total
    c.print(f"tokens not recomputed: {human_tokens(res.reused_tokens)} "
            f"({res.reused_tokens / max(res.prompt_tokens, 1):.1%}); prefill time saved: {saved:.1f} s of "
            f"{total:.1f} s ({saved / total if total else 0:.1%})")
    for line in break_even(res):
        c.print(f"[bold]note:[/bold] {line}")
    c.print(f"offline optimum at the same capacities: {res.optimal_same_capacity:.1%} "
            f"(gap {res.gap:+.1%}); L1 alone: optimum {res.optimal_l1:.1%} vs L1 hits "
            f"{res.tiers['l1']['token_rate']:.1%}; infinite capacity: {res.infinite:.1%}")
    if res.curve:
        ct = Table(title=f"Hit rate vs L1 capacity (eviction {res.policies['eviction']}, no L2/L3)")
        for col in ("capacity", "tokens", "KV bytes", "policy", "optimal", "policy/optimal"):
            ct.add_column(col, justify="right")
        for p in res.curve:
            ratio = p.policy / p.optimal if p.optimal else 1.0
            ct.add_row(f"{p.fraction:.0%}", human_tokens(p.capacity_tokens), human_bytes(p.capacity_tokens * bpt),
                       f"{p.policy:.1%}", f"{p.optimal:.1%}", f"{ratio:.0%}")
        c.print(ct)
    c.print(f"[bold]advice:[/bold] {advice(res.hit_rate, res.infinite)}")
    if res.sizing is not None:
        c.print(f"[bold]sizing:[/bold] {res.sizing.describe(bpt, res.policies['write'])}")
    c.print(f"replay: {res.wall_s:.2f} s wall, {res.cache_s:.2f} s in cache calls "
            f"({res.requests / max(res.wall_s, 1e-9):.0f} requests/s)"
            + ("; background copies finished before each next request (--no-settle: back to back)"
               if res.settled else ""))


def write_outputs(res: BenchResult, out: Path, extra: dict[str, Any] | None = None) -> list[Path]:
    """``result.json``, ``requests.csv``, ``curve.csv`` and ``hit_rate.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    files = []
    data = res.to_dict()
    if extra:
        data.update(extra)
    p = out / "result.json"
    p.write_text(json.dumps(data, indent=2, default=str))
    files.append(p)
    r = res.per_request
    if r is not None:
        p = out / "requests.csv"
        with p.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["request", "prompt_tokens", "l1_hit", "l2_hit", "l3_hit", "not_recomputed"])
            for i in range(r.requests):
                w.writerow([i, int(r.prompt[i]), int(r.l1[i]), int(r.l2[i]), int(r.l3[i]), int(r.reused[i])])
        files.append(p)
    p = out / "curve.csv"
    with p.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["fraction", "capacity_tokens", "policy_hit_rate", "optimal_hit_rate"])
        for c in res.curve:
            w.writerow([c.fraction, c.capacity_tokens, f"{c.policy:.6f}", f"{c.optimal:.6f}"])
    files.append(p)
    from hicache.bench.plot import plot_result

    files.append(plot_result(res, out / "hit_rate.png"))
    return files
