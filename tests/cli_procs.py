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


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without its ``HICACHE_*`` variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    return {**env, **(extra or {})}


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 60.0,
            cwd: Path | None = None, **popen: Any) -> subprocess.CompletedProcess[str]:
    """Run ``hicache ARGS`` to completion (environment: :func:`cli_env` with ``env``); a command still
    running after ``timeout_s`` (a server that started although it should not have) is killed and reported
    with return code None and what it printed so far."""
    try:
        return subprocess.run([sys.executable, "-m", "hicache.cli", *args], cwd=cwd or REPO, env=cli_env(env),
                              capture_output=True, text=True, errors="replace", timeout=timeout_s, **popen)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        return subprocess.CompletedProcess(e.cmd, None, out, err)  # type: ignore[arg-type]


def start_cli(args: list[str], marker: str) -> tuple[subprocess.Popen[str], int]:
    """Run ``hicache ARGS`` (without the caller's ``HICACHE_*`` environment) until it prints a line starting
    with ``marker`` and then ``host:port``; returns the process and that port."""
    proc = subprocess.Popen([sys.executable, "-m", "hicache.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=cli_env())
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
