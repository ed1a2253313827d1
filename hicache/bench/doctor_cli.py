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

from hicache.bench.cli import add_common, check_outputs, options
from hicache.bench.doctor import diagnose_and_render
from hicache.bench.errors import BenchInputError
from hicache.bench.optimal import page_trace
from hicache.cli import HelpFormatter

PROG = "hicache doctor"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "doctor", help="find what in the prompts breaks prefix reuse",
        description=__doc__, formatter_class=HelpFormatter)
    add_common(p)
    p.add_argument("--json", metavar="PATH", help="write the diagnosis as JSON here")
    return p


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
