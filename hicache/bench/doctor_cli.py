"""``hicache doctor``: what in the prompts breaks prefix reuse, and what fixing it would buy.

Replays a workload or a trace (text traces give the most readable report), finds where misses diverge
from the nearest earlier prompt, groups the diverging spans (timestamps, ids, names...), simulates moving
them to the end of the prompt and reports the hit rate before and after, with advice by the 60% rule:
under 60% fix the prompt structure; above 60% with little gain, add tiers.

Examples::

    hicache doctor --workload rag --plant timestamp
    hicache doctor --trace prompts.jsonl --l1 64k
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hicache.bench.cli import add_common, check_outputs, options
from hicache.bench.doctor import DoctorReport, run_doctor
from hicache.bench.errors import BenchInputError
from hicache.bench.optimal import page_trace
from hicache.bench.tokenizer import WordTokenizer
from hicache.cli import HelpFormatter

PROG = "hicache doctor"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "doctor", help="find what in the prompts breaks prefix reuse",
        description=__doc__, formatter_class=HelpFormatter)
    add_common(p)
    p.add_argument("--json", metavar="PATH", help="write the diagnosis as JSON here")
    return p


def render(rep: DoctorReport, console: Console) -> None:
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
    tok = wl.tokenizer
    token_text = tok.token_text if isinstance(tok, WordTokenizer) else (lambda i: tok.decode([i]))
    rep = run_doctor(wl.requests, wl.page_size, token_text, capacity_tokens, policy)
    render(rep, console)
    return rep


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        from hicache.bench.run import MODEL_LAYOUTS, load_requests

        args.capacities = ""
        check_outputs(args.trace, args.json)
        opts = options(args)
        wl = load_requests(opts)
        ws = page_trace(wl.requests, wl.page_size).working_set_tokens
        cap = opts.l1.to_tokens(MODEL_LAYOUTS[opts.model_layout].bytes_per_token, ws) // wl.page_size * wl.page_size
        rep = diagnose_and_render(wl, max(cap, wl.page_size), opts.eviction_policy, console)
        if args.json:
            p = Path(args.json)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(rep.to_dict(), indent=2, default=str))
        return 0
    except BenchInputError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
