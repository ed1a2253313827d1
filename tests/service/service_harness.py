"""Runs ``hicache serve`` in a subprocess on free loopback ports (used by the service tests' fixtures)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16", "page_size": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProc:
    proc: subprocess.Popen[str]
    port: int
    metrics_port: int
    config: dict[str, Any]
    lines: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def log(self) -> str:
        return "".join(self.lines)


def start_server(tmp: Path, **sections: dict[str, Any]) -> ServerProc:
    """Start ``hicache serve`` with a small CPU config (overridden per section) and wait until it listens."""
    metrics_port = free_port()
    cfg: dict[str, dict[str, Any]] = {
        "layout": dict(LAYOUT),
        "cache": {"l1_tokens": 16 * 256, "l2_tokens": 16 * 256},
        "serve": {"port": 0, "metrics_port": metrics_port, "shutdown_grace_s": 5.0},
    }
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    path = tmp / f"serve-{metrics_port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "hicache.cli", "serve", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    server = ServerProc(proc, 0, metrics_port, cfg)
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        server.lines.append(line)
        if line.startswith("hicache serve: listening on"):
            server.port = int(line.split()[4].rsplit(":", 1)[1])
            break
    if not server.port:
        proc.kill()
        raise RuntimeError("server did not start:\n" + server.log() + (proc.stdout.read() or ""))

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            server.lines.append(line)

    threading.Thread(target=drain, daemon=True).start()
    return server


def serve_prompt(client: Any, tokens: Any, request_id: str, tenant: str = "") -> None:
    """One request as an engine makes it over gRPC: match, allocate the rest, commit, release."""
    import numpy as np

    m = client.match(tokens, request_id, tenant=tenant)
    new = client.allocate(request_id, m.num_pages - m.l1_pages)
    client.commit(request_id, tokens, np.concatenate([m.device_indices, new]))
    client.release(request_id)
