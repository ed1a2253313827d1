"""``hicache route`` as a process: flags, config file, health, /metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from router_helpers import LAYOUT, node_config, tokens

from hicache.cli import main as cli_main
from hicache.client import AsyncHiCacheClient
from hicache.router.client import AsyncRouterClient
from hicache.service.server import NodeServer

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_route_without_nodes_is_a_usage_error() -> None:
    env = {k: v for k, v in os.environ.items() if k.startswith("HICACHE_")}
    for k in env:
        del os.environ[k]
    try:
        assert cli_main(["route", "--port", "0"]) == 2
        assert cli_main(["route", "--node", "bad"]) == 2  # ConfigError: one line, exit 2
    finally:
        os.environ.update(env)


def test_hicache_route_process(tmp_path: Path) -> None:
    async def main() -> None:
        node = NodeServer(node_config(serve={"port": 0, "metrics_port": 0, "shared_pool": False}))
        await node.start()
        metrics_port = free_port()
        cfg = tmp_path / "router.yaml"
        cfg.write_text(yaml.safe_dump({"layout": LAYOUT, "router": {"stats_interval_s": 0.2}}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hicache.cli", "route", "--config", str(cfg), "--node",
            f"gpu0=127.0.0.1:{node.port}", "--port", "0", "--metrics-port", str(metrics_port),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env, cwd=REPO)
        assert proc.stdout is not None
        lines: list[str] = []
        try:
            port = 0
            while not port:
                line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
                assert line, "".join(lines)
                lines.append(line)
                if line.startswith("hicache route: listening on"):
                    port = int(line.split()[4].rsplit(":", 1)[1])
            async with AsyncRouterClient(f"127.0.0.1:{port}") as rc, \
                    AsyncHiCacheClient(f"127.0.0.1:{node.port}") as nc:
                for _ in range(200):
                    nodes = (await rc.list_nodes()).nodes
                    if nodes[0].connected:
                        break
                    await asyncio.sleep(0.05)
                assert nodes[0].connected and nodes[0].namespace_ok, nodes
                health = health_pb2_grpc.HealthStub(rc.channel)
                h = await health.Check(health_pb2.HealthCheckRequest(service="hicache.v1.Router"))
                assert h.status == health_pb2.HealthCheckResponse.SERVING
                toks = tokens(1, 6)
                m = await nc.match(toks, "r1")
                new = await nc.allocate("r1", 6)
                await nc.commit("r1", toks, np.concatenate([m.device_indices, new]))
                await nc.release("r1")
                for _ in range(200):
                    d = await rc.route(toks)
                    await rc.complete(d.route_id)
                    if d.l1_pages == 6:
                        break
                    await asyncio.sleep(0.05)
                assert (d.node, d.address, d.l1_pages) == ("gpu0", f"127.0.0.1:{node.port}", 6)
            text = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode())
            assert 'hicache_router_routes_total{node="gpu0",reason="prefix"}' in text
            assert 'hicache_router_node_connected{node="gpu0"} 1.0' in text
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await node.stop(0.1)

    asyncio.run(main())


def test_route_and_status_refuse_the_same_addresses(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``hicache route --node`` and ``hicache status`` check addresses with one helper: the same address
    is refused by both with exit code 2 and one line giving the same reason, before anything connects."""
    for k in [k for k in os.environ if k.startswith("HICACHE_")]:
        monkeypatch.delenv(k)
    for bad, why in [("h", "no port"), ("h:0", "port 0 is out of range"), ("h:99999", "port 99999 is out of range"),
                     ("h:abc", "port 'abc' is not a number"), (":50051", "no host"),
                     ("http://h:1", "http:// is not an address scheme"), ("::1:50051", "needs brackets"),
                     ("bad host:1", "not a host name"), ("", "empty")]:
        assert cli_main(["status", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hicache status: target {bad!r}: ") and why in err and err.count("\n") == 1, err
        assert cli_main(["route", "--port", "0", "--node", f"gpu0={bad}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hicache route: --node: 'gpu0={bad}': ") and why in err and err.count("\n") == 1, err


def test_route_refuses_one_node_twice(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("HICACHE_")]:
        monkeypatch.delenv(k)
    for nodes, why in [(["a=h:1", "a=g:1"], "node names must be unique, repeated: ['a']"),
                       (["a=h:1", "b=grpc://h:1"], "h:1 is listed twice (as 'a' and 'b')"),
                       (["a=h:1", "a b=g:1"], "bad node name 'a b'")]:
        argv = ["route", "--port", "0"] + [x for n in nodes for x in ("--node", n)]
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("hicache route: --node: ") and why in err and err.count("\n") == 1, err
