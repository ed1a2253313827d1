"""Match over gRPC on loopback vs the same call in-process: requests/s, p50 and p99.

Setup: ``hicache serve`` runs in its own process (grpc.aio on uvloop, CPU pool) holding one cached
8,192-token prompt (page size 64: 128 pages on L1). Clients are asyncio tasks multiplexed over one
channel per client process (default: 1, 8 and 64 concurrent clients); each sends ``Match(peek=True)`` on
that prompt -- the full match (radix walk comparing 8,192 tokens, lock, hit counters, release; no L3,
so the server skips hashing page keys, which commit computes when pages are inserted) -- either as
one unary RPC per call (``unary``) or as messages on its own MatchStream (``stream``). Closed loop
(each client sends when its last reply arrived) gives the saturation rate; at saturation latency is
just clients / rate (Little's law), so an open-loop run at ``--rate`` (paced sends, latency from the
scheduled send time) gives the latency at that load. The baseline is the same call in this process:
``cache.match(tokens, keys=False)`` + ``cache.release``. Server and clients share the machine's cores:
the figures are "clients included".

    python benchmarks/grpc_latency.py [--tokens 8192] [--clients 1 8 64] [--seconds 4] [--client-procs 1]
                                      [--json out/grpc_latency.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUT = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": "bfloat16", "page_size": 64}


def prompt(n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 128_000, n).astype(np.uint32)


def config(tokens: int, port: int) -> dict[str, Any]:
    return {
        "layout": LAYOUT,
        "cache": {"l1_tokens": max(4 * tokens, 65536), "l2_tokens": 0, "write_policy": "write_through"},
        "serve": {"port": port, "metrics_port": 0, "max_concurrency": 1024, "max_request_tokens": 1 << 20},
    }


def pct(lat: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(lat), q)) * 1e3 if lat else float("nan")


# ---------------------------------------------------------------------- client processes
def _client_proc(target: str, tokens: bytes, mode: str, clients: int, rate: float, start_at: float,
                 seconds: float, out: Any) -> None:
    """``clients`` asyncio clients on one channel. ``rate`` 0: closed loop (each sends its next Match when
    the last returns); else open loop, each client paced at rate/clients per second, latency counted
    from the scheduled send time (a late reply delays nothing but shows in the figures)."""
    import gc

    import uvloop

    from hicache.client import AsyncHiCacheClient

    gc.collect()
    gc.freeze()  # keep full collections short: they show up as tail latency

    async def main() -> tuple[list[float], int, float, float]:
        lat: list[float] = []
        errors = 0
        last_done = 0.0
        async with AsyncHiCacheClient(target, timeout_s=10) as c:
            await c.wait_ready()
            await c.match(tokens, peek=True)  # connect + warm
            await asyncio.sleep(max(0.0, start_at - time.time()))
            pc = time.perf_counter
            cpu0 = time.process_time()
            t_start = pc()
            end = t_start + seconds

            shared = c.match_stream(pipelined=True) if mode == "pipelined" else None

            async def worker(i: int) -> None:
                nonlocal errors, last_done
                stream = c.match_stream() if mode == "stream" else None
                call = stream.match if stream is not None else shared.match if shared is not None else c.match
                await call(tokens, peek=True)

                async def send() -> float:
                    await call(tokens, peek=True)
                    return pc()

                e, done = await paced(send, i, clients, rate, t_start, end, lat)
                errors += e
                last_done = max(last_done, done)
                if stream is not None:
                    await stream.close()

            await asyncio.gather(*(worker(i) for i in range(clients)))
            if shared is not None:
                await shared.close()
            cpu = time.process_time() - cpu0
        return lat, errors, last_done, cpu

    out.put(uvloop.run(main()))


async def paced(send: Callable[[], Awaitable[float]], i: int, clients: int, rate: float, t_start: float,
                end: float, lat: list[float]) -> tuple[int, float]:
    """One client's loop until ``end`` (perf_counter seconds). Closed loop (``rate`` 0): send as soon as the
    last reply came. Open loop: each of ``clients`` sends every ``clients / rate`` s, client ``i`` offset by
    ``i / clients`` of that period from ``t_start``, and latency runs from the scheduled send (so a late
    send counts its wait). ``send`` returns when the reply that ends the latency came. Appends latencies to
    ``lat``; returns (errors, the last completion's offset from ``t_start``)."""
    pc = time.perf_counter
    period = clients / rate if rate else 0.0
    due = t_start + period * (i / clients - 1)  # the first send at t_start + period * i / clients
    errors, last = 0, 0.0
    while True:
        if period:
            due += period
            delay = due - pc()
            if delay > 0:
                await asyncio.sleep(delay)
        t0 = due if period else pc()
        if t0 >= end:
            break
        try:
            done = await send()
        except Exception:
            errors += 1
            continue
        lat.append(done - t0)
        last = max(last, pc() - t_start)
    return errors, last


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_level(target: str, tokens: bytes, mode: str, clients: int, procs: int, seconds: float,
              rate: float = 0.0, server_pid: int = 0) -> dict[str, Any]:
    procs = max(1, min(procs, clients))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 2.5  # after every client process has imported and connected
    per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    ps = [ctx.Process(target=_client_proc, args=(target, tokens, mode, n, rate * n / clients, start_at, seconds, q))
          for n in per]
    for p in ps:
        p.start()
    lat: list[float] = []
    errors = 0
    elapsed = seconds
    client_cpu = 0.0
    time.sleep(max(0.0, start_at - time.time()))
    srv0 = proc_cpu_s(server_pid) if server_pid else 0.0
    for _ in ps:
        part, err, last, cpu = q.get(timeout=seconds + 120)
        lat.extend(part)
        errors += err
        elapsed = max(elapsed, last)
        client_cpu += cpu
    srv_cpu = proc_cpu_s(server_pid) - srv0 if server_pid else float("nan")
    for p in ps:
        p.join()
    return {"mode": mode, "clients": clients, "client_procs": procs, "offered_per_s": rate or None,
            "requests": len(lat), "errors": errors, "req_per_s": len(lat) / elapsed, "p50_ms": pct(lat, 50),
            "p99_ms": pct(lat, 99), "server_cpu_us_per_req": srv_cpu / max(len(lat), 1) * 1e6,
            "client_cpu_us_per_req": client_cpu / max(len(lat), 1) * 1e6}


# ---------------------------------------------------------------------- in-process baseline
def in_process(tokens: np.ndarray, seconds: float) -> dict[str, float]:
    from hicache.cache import HiCache
    from hicache.config import config_from_dict

    cache = HiCache(config_from_dict(config(len(tokens), 0)))
    req = cache.match(tokens)
    pages = cache.alloc(req, len(tokens) // LAYOUT["page_size"])
    cache.commit(req, tokens, pages)
    cache.release(req)
    tb = tokens.tobytes()
    lat: list[float] = []
    pc = time.perf_counter
    end = pc() + seconds
    cpu0 = time.process_time()
    while pc() < end:
        t0 = pc()
        r = cache.match(np.frombuffer(tb, dtype="<u4"), keys=False)  # what the server does for this Match
        cache.release(r)
        lat.append(pc() - t0)
    assert r.l1_pages == len(tokens) // LAYOUT["page_size"]
    cpu = time.process_time() - cpu0
    cache.close()
    return {"clients": 1, "cpu_us_per_req": cpu / len(lat) * 1e6,
            "requests": len(lat), "req_per_s": len(lat) / seconds, "p50_ms": pct(lat, 50),
            "p99_ms": pct(lat, 99)}


# ---------------------------------------------------------------------- server
def start_server(tokens: int, tmp: Path) -> tuple[subprocess.Popen[str], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(config(tokens, port)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "hicache.cli", "serve", "--config", str(path),
                             "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    return proc, f"127.0.0.1:{port}"


def seed_prompt(target: str, tokens: np.ndarray) -> int:
    from hicache.client import HiCacheClient

    with HiCacheClient(target) as c:
        m = c.match(tokens, "seed")
        new = c.allocate("seed", m.num_pages - m.l1_pages)
        c.commit("seed", tokens, np.concatenate([m.device_indices, new]))
        c.release("seed")
        return c.match(tokens, peek=True).l1_pages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--client-procs", type=int, default=1, help="client processes sharing the clients")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--modes", nargs="+", default=["unary", "stream"], choices=["unary", "stream", "pipelined"],
                    help="unary: one Match RPC per call; stream: Match messages over one MatchStream per client; "
                    "pipelined: the clients of a process share one MatchStream")
    ap.add_argument("--rate", type=float, default=3000.0,
                    help="also run open loop at this offered rate with the largest client count (0: skip)")
    ap.add_argument("--json", default="out/grpc_latency.json")
    args = ap.parse_args(argv)

    tokens = prompt(args.tokens)
    base = in_process(tokens, args.seconds)
    print(f"in-process  match+release  {args.tokens} tokens: {base['req_per_s']:8.0f} req/s  "
          f"p50 {base['p50_ms']:.3f} ms  p99 {base['p99_ms']:.3f} ms  CPU/req {base['cpu_us_per_req']:.0f} us")
    levels = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, target = start_server(args.tokens, Path(tmp))
        try:
            hit = seed_prompt(target, tokens)
            assert hit == args.tokens // LAYOUT["page_size"], hit
            runs = [(m, c, 0.0) for m in args.modes for c in args.clients]
            if args.rate:
                runs += [(m, max(args.clients), args.rate) for m in args.modes]
            for mode, c, rate in runs:
                r = run_level(target, tokens.tobytes(), mode, c, args.client_procs, args.seconds, rate, proc.pid)
                r["vs_in_process"] = r["req_per_s"] / base["req_per_s"]
                levels.append(r)
                loop = f"open loop {rate:.0f}/s" if rate else "closed loop"
                print(f"gRPC {mode:6s} {c:3d} clients, {loop:19s}: {r['req_per_s']:8.0f} req/s  "
                      f"p50 {r['p50_ms']:7.3f} ms  p99 {r['p99_ms']:7.3f} ms  "
                      f"({r['vs_in_process']:.2f}x in-process; CPU/req server {r['server_cpu_us_per_req']:.0f} us "
                      f"client {r['client_cpu_us_per_req']:.0f} us; {r['errors']} errors)")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    result = {
        "benchmark": "grpc_latency", "tokens": args.tokens, "page_size": LAYOUT["page_size"],
        "seconds": args.seconds, "cpus": os.cpu_count(), "python": platform.python_version(),
        "machine": platform.machine(), "load_avg_before": os.getloadavg(),
        "in_process": base, "grpc": levels,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
