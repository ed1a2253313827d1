"""``hicache bench``: measure the prefix-cache hit rate of a workload or a trace.

With no arguments it replays the mixed workload (RAG + few-shot + multi-turn) against an in-process
cache on CPU -- L1 10% and L2 25% of the working set, L3 a file store in a temporary folder -- and
prints hit rates per tier, tokens and prefill time saved, the offline optimum, the infinite-capacity
bound and hit rate vs capacity, in well under a minute. ``--out DIR`` also writes JSON, CSV and a PNG.

Examples::

    hicache bench
    hicache bench --workload rag --l1 64k --l2 2GiB --eviction-policy lru
    hicache bench --trace mooncake.jsonl --l1 10% --l2 0 --l3 none --out out/mooncake
    hicache bench --workload rag --plant timestamp --doctor
    hicache bench --policy-table --trace mooncake.jsonl
    hicache bench --target grpc://127.0.0.1:50051 --workload multiturn

Bad input (a missing trace, a malformed line, an unknown workload) exits with code 2 and one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hicache.bench.errors import BenchInputError
from hicache.bench.units import parse_size
from hicache.cli import HelpFormatter
from hicache.config import PREFETCH_POLICIES, WRITE_POLICIES, CacheConfig

PROG = "hicache bench"


def add_common(p: argparse.ArgumentParser) -> None:
    """Flags shared with ``hicache doctor``: what to replay."""
    g = p.add_argument_group("requests")
    g.add_argument("--workload", default="mixed", help="rag | fewshot | multiturn | mixed (default: mixed)")
    g.add_argument("--trace", metavar="PATH", help="replay a trace file instead (own JSONL or Mooncake)")
    g.add_argument("--format", dest="trace_format", default="auto", help="trace format: auto | jsonl | mooncake")
    g.add_argument("--requests", type=int, default=600, help="workload size in requests (default: 600)")
    g.add_argument("--limit", type=int, help="replay only the first N requests of the trace")
    g.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    g.add_argument("--plant", metavar="SPAN", help="plant a volatile span at the start of every workload prompt: "
                   "timestamp | session | request_id")
    g.add_argument("--tokenizer", help="tokenizer for text traces: 'word' (built in, default) or a Hugging Face "
                   "name (needs transformers)")
    g.add_argument("--page-size", type=int, help="tokens per page (default: 64; 512 for Mooncake traces)")
    g.add_argument("--l1", default="10%", help="L1 capacity: tokens (65536, 64k), bytes (2GiB) or %% of the "
                   "working set (default: 10%%)")
    g.add_argument("--eviction-policy", default=CacheConfig.eviction_policy,
                   help=f"eviction policy (default: {CacheConfig.eviction_policy})")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench", help="measure the prefix-cache hit rate of a workload or trace",
        description=__doc__, formatter_class=HelpFormatter)
    add_common(p)
    g = p.add_argument_group("cache")
    g.add_argument("--l2", default="25%", help="L2 capacity, same units as --l1; 0 disables L2 (default: 25%%)")
    g.add_argument("--l3", default="file", help="L3: file (temporary folder, default), memory, none, or a storage "
                   "URL (redis://..., file:///path)")
    g.add_argument("--write-policy", default=CacheConfig.write_policy,
                   help=f"write_through | write_through_selective | write_back (default: {CacheConfig.write_policy})")
    g.add_argument("--prefetch-policy", default="wait_complete",
                   help="best_effort | wait_complete | timeout (default: wait_complete; a node's "
                   "storage.prefetch_policy defaults to timeout)")
    g.add_argument("--target", default="inproc",
                   help="inproc (default), or grpc://host:port of a node or of a router (hicache route); with "
                   "grpc:// the node's page size, capacities, L3 and policies apply, not --l1/--l2/--l3/--*-policy "
                   "(--eviction-policy still sets the capacity curve's)")
    g.add_argument("--clear", action="store_true",
                   help="start cold: drop the L1 and L2 pages of the grpc:// target first (every node of a "
                   "router; their stores keep their pages). Without it a node keeps what earlier runs left")
    g = p.add_argument_group("replay and report")
    g.add_argument("--follow-timestamps", action="store_true", help="start requests at their trace times")
    g.add_argument("--speed", type=float, default=1.0, help="time scale with --follow-timestamps (10 = 10x faster)")
    g.add_argument("--settle", action=argparse.BooleanOptionalAction, default=None,
                   help="wait for each request's background copies (L1->L2 backups, L3 writes) before the next, "
                   "so the hit rate does not depend on this machine's speed (default: on, off with "
                   "--follow-timestamps; a node's Flush call does it for a grpc:// target)")
    g.add_argument("--model-layout", default="llama-3.1-8b",
                   help="KV layout for bytes and times: llama-3.1-8b | llama-3.1-70b | qwen2.5-7b | deepseek-v3 | "
                   "small | tiny")
    g.add_argument("--prefill-rate", default="41000", help="prefill tokens/s (default 41000: 8B-shaped model, "
                   "eager PyTorch, H200), or 'measure' (reference decoder of --model-layout's shape, this machine; "
                   "llama-3.1-8b on a GPU, small and tiny anywhere)")
    g.add_argument("--l2-bandwidth", type=float, default=50e9, help="L2 -> L1 bytes/s (default 50e9)")
    g.add_argument("--l3-bandwidth", type=float, default=2e9, help="L3 -> L1 bytes/s (default 2e9)")
    g.add_argument("--capacities", default="5,10,20,30,50,75,100",
                   help="hit rate vs capacity: %% of the working set (default: 5,10,20,30,50,75,100; '' skips)")
    g.add_argument("--out", metavar="DIR", help="write result.json, requests.csv, curve.csv, hit_rate.png here")
    g.add_argument("--json", metavar="PATH", help="write the result as JSON here")
    g.add_argument("--doctor", action="store_true", help="also diagnose what in the prompts breaks reuse")
    g.add_argument("--policy-table", action="store_true", help="compare lru, lfu, arc, the default policy "
                   "and --eviction-policy (if another) with the optimum, L1 only, at 5/10/30/50%% of the pages of "
                   "each built-in workload and of --trace; prints the default's margin over lru per row and the "
                   "worst margin; only --requests, --seed, --trace, --limit, --page-size and --json apply")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _fractions(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            v = float(part.strip().rstrip("%"))
        except ValueError:
            raise BenchInputError(f"--capacities: not a percentage: {part!r}") from None
        if not 0 < v <= 1000:
            raise BenchInputError(f"--capacities: {v} is not in (0, 1000]")
        out.append(v / 100.0)
    return out


def prefill_rate(args: argparse.Namespace, console: Console | None = None) -> float:
    text = str(getattr(args, "prefill_rate", "41000"))
    if text == "measure":
        from hicache.bench.prefill import measure_prefill_rate

        m = measure_prefill_rate(getattr(args, "model_layout", "llama-3.1-8b"))
        if console is not None:
            console.print(f"measured prefill: {m.tokens_per_s:,.0f} tokens/s ({m.preset} shape, {m.tokens}-token "
                          f"prompt, {m.device})")
        return m.tokens_per_s
    try:
        rate = float(text)
    except ValueError:
        raise BenchInputError(f"--prefill-rate: expected tokens/s or 'measure', got {text!r}") from None
    if rate <= 0:
        raise BenchInputError(f"--prefill-rate: must be > 0, got {text}")
    return rate


def check_request_flags(args: argparse.Namespace) -> None:
    """Refuse flags that the requests asked for would ignore: ``--limit`` and ``--format`` without a trace,
    ``--plant`` with one (it plants into generated prompts only)."""
    if not args.trace:
        if args.limit is not None:
            raise BenchInputError("--limit: applies to --trace only (a workload's size is --requests)")
        if args.trace_format != "auto":
            raise BenchInputError(f"--format {args.trace_format}: applies to --trace only")
    elif args.plant:
        raise BenchInputError("--plant: plants a span into generated workload prompts; a --trace is replayed as is")


def check_policies(args: argparse.Namespace) -> None:
    """``--write-policy`` and ``--prefetch-policy`` among the cache's, refused naming the flag."""
    for flag, dest, known in (("--write-policy", "write_policy", WRITE_POLICIES),
                              ("--prefetch-policy", "prefetch_policy", PREFETCH_POLICIES)):
        value = getattr(args, dest, None)  # hicache doctor has neither
        if value is not None and value not in known:
            raise BenchInputError(f"{flag}: unknown policy {value!r}; known: {', '.join(known)}")


def options(args: argparse.Namespace, console: Console | None = None) -> Any:
    from hicache.bench.run import BenchOptions

    check_request_flags(args)
    check_policies(args)
    return BenchOptions(
        workload=args.workload, trace=args.trace, trace_format=args.trace_format, requests=args.requests,
        limit=args.limit, seed=args.seed, plant=args.plant, tokenizer=args.tokenizer,
        l1=parse_size(args.l1, "--l1"), l2=parse_size(getattr(args, "l2", "0"), "--l2"),
        l3=getattr(args, "l3", "none"), page_size=args.page_size,
        write_policy=getattr(args, "write_policy", CacheConfig.write_policy),
        eviction_policy=args.eviction_policy, prefetch_policy=getattr(args, "prefetch_policy", "wait_complete"),
        target=getattr(args, "target", "inproc"), model_layout=getattr(args, "model_layout", "llama-3.1-8b"),
        prefill_rate=prefill_rate(args, console), l2_bandwidth=getattr(args, "l2_bandwidth", 50e9),
        l3_bandwidth=getattr(args, "l3_bandwidth", 2e9), curve=_fractions(getattr(args, "capacities", "")),
        follow_timestamps=getattr(args, "follow_timestamps", False), speed=getattr(args, "speed", 1.0),
        settle=getattr(args, "settle", None),
        clear=getattr(args, "clear", False),
    )


def progress_bar(console: Console, quiet: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=quiet or not console.is_terminal)


def staged(bar: Progress) -> Callable[[str, int, int], None]:
    tasks: dict[str, Any] = {}

    def cb(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done)

    return cb


def run_policy_table(args: argparse.Namespace, console: Console) -> int:
    """Every baseline policy (lru, lfu, arc), the default and ``--eviction-policy`` on the built-in
    workloads and ``--trace``, L1 only, at 5/10/30/50% of each trace's pages; per row the optimum and the
    default's margin over LRU, then the worst margin. Nothing is tuned on the traces it reports."""
    from hicache.bench.policy_table import BASELINES, EVAL_FRACTIONS, policy_table, render
    from hicache.bench.run import BenchOptions, load_requests

    check_request_flags(args)
    default = CacheConfig.eviction_policy
    policies = list(dict.fromkeys([*BASELINES, default, args.eviction_policy]))
    traces = []
    for w in ("rag", "fewshot", "multiturn"):
        wl = load_requests(BenchOptions(workload=w, requests=args.requests, seed=args.seed,
                                        page_size=args.page_size))
        traces.append((w, wl.requests, wl.page_size))
    if args.trace:
        wl = load_requests(BenchOptions(trace=args.trace, trace_format=args.trace_format, limit=args.limit,
                                        page_size=args.page_size))
        traces.append((Path(args.trace).name, wl.requests, wl.page_size))
    with progress_bar(console, args.quiet) as bar:
        task = bar.add_task("policy table", total=len(traces) * len(EVAL_FRACTIONS))
        rows = policy_table(traces, policies, EVAL_FRACTIONS, tick=lambda _: bar.advance(task), fast=True)
    console.print(f"Hit rate (%) of each policy, L1 only; margin = {default} minus lru, in points",
                  markup=False, highlight=False)
    for line in render(rows, policies, default):
        console.print(line, markup=False, highlight=False)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([vars(r) for r in rows], indent=2))
    return 0


OUTPUT_FILES = ("result.json", "requests.csv", "curve.csv", "hit_rate.png")  # what --out DIR holds


def check_outputs(trace: str | None, json_path: str | None, out_dir: str | None = None) -> None:
    """Refuse output paths that would overwrite the trace being read, a --out that is a file, or a place
    that cannot be written (a file where a folder is needed, a folder without write permission)
    (:class:`BenchInputError`), before any work is done."""
    src = Path(trace).resolve() if trace else None
    outs = [("--json", Path(json_path))] if json_path else []
    if out_dir:
        d = Path(out_dir)
        if d.exists() and not d.is_dir():
            raise BenchInputError(f"--out {out_dir}: exists and is not a directory")
        outs += [("--out", d / f) for f in OUTPUT_FILES]
    for flag, p in outs:
        if src is not None and p.resolve() == src:
            raise BenchInputError(f"{p}: is the trace being read; write the results elsewhere")
        if p.is_dir():
            raise BenchInputError(f"{p}: is a directory, not a file to write")
        # the folder that exists on the way to p is where the first file or folder is made
        base = next((a for a in p.parents if a.exists()), Path("."))
        if not base.is_dir():
            raise BenchInputError(f"{flag} {p}: {base} is a file, not a directory")
        if not os.access(p if p.exists() else base, os.W_OK):
            raise BenchInputError(f"{flag} {p}: cannot write in {base} (permission denied)")


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        check_outputs(args.trace, args.json, None if args.policy_table else args.out)
        if args.policy_table:
            return run_policy_table(args, console)
        from hicache.bench.report import render, write_outputs
        from hicache.bench.run import load_requests, run_bench

        opts = options(args, console)
        wl = load_requests(opts)
        with progress_bar(console, args.quiet) as bar:
            res = run_bench(opts, wl, staged(bar))
        render(res, console)
        extra: dict[str, Any] = {}
        if args.doctor:
            from hicache.bench.doctor import diagnose_and_render

            extra["doctor"] = diagnose_and_render(wl, res.l1_tokens, opts.eviction_policy, console).to_dict()
        if args.out:
            files = write_outputs(res, Path(args.out), extra)
            console.print("wrote " + ", ".join(str(f) for f in files))
        if args.json:
            p = Path(args.json)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(res.to_dict() | extra, indent=2, default=str))
        return 0
    except BenchInputError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
