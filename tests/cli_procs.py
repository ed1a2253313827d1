"""Start ``hicache`` subcommands (``serve``, ``route``) as subprocesses on free loopback ports, and stop them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVE_READY = "hicache serve: listening on"
ROUTE_READY = "hicache route: listening on"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_cli(args: list[str], marker: str) -> tuple[subprocess.Popen[str], int]:
    """Run ``hicache ARGS`` (without the caller's ``HICACHE_*`` environment) until it prints a line starting
    with ``marker`` and then ``host:port``; returns the process and that port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    proc = subprocess.Popen([sys.executable, "-m", "hicache.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(marker):
            return proc, int(line[len(marker):].split()[0].rsplit(":", 1)[1])
    proc.kill()
    pytest.fail(f"hicache {args[0]} did not start:\n" + "".join(lines))


def stop(procs: Iterable[subprocess.Popen[Any]], timeout_s: float = 10.0) -> None:
    """SIGTERM every process, then wait (SIGKILL what outlives ``timeout_s``)."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
