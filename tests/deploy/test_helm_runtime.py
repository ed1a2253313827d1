"""The rendered chart runs: Redis, the node and the router started from what Helm rendered.

One release (CPU nodes, bundled Redis with a generated password, auth on) is rendered; then, on loopback:
``redis-server`` with the Redis container's arguments, ``hicache serve`` with the ConfigMap's hicache.yaml
and the node container's environment (Secret values and ``$(VAR)`` expanded as the kubelet does), and
``hicache route`` with router.yaml and the router container's arguments. Only addresses are rewritten
(cluster DNS names -> 127.0.0.1, fixed ports -> free ones). The image's health check script must report
SERVING for both, /metrics must answer, and pages committed through the node must land in that Redis.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

pytest.importorskip("helm_python")

from helm_render import REPO, Rendered, container, container_env, render

from hicache.storage.redis_local import redis_server_binary

pytestmark = [pytest.mark.redis,
              pytest.mark.skipif(redis_server_binary() is None, reason="redis-server not installed")]

PS = 16
VALUES: dict[str, Any] = {
    "node": {"kind": "statefulset", "replicas": 1, "gpu": {"enabled": False}},
    "auth": {"enabled": True},
    "config": {"layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16", "page_size": PS},
               "cache": {"l1_tokens": 64 * PS, "l2_tokens": 64 * PS, "write_policy": "write_through"},
               "serve": {"shutdown_grace_s": 5.0}},
}
HEALTHCHECK = REPO / "deploy" / "healthcheck.py"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A child process whose output is collected; ``wait_for(prefix)`` returns the first line starting with it."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=cwd)
        self.lines: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append(line)
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_for(self, prefix: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and self.proc.stdout is not None
                                 and self.proc.stdout.closed):
                    raise AssertionError(f"no line {prefix!r}:\n{self.log()}")
                self._cv.wait(min(left, 0.5))

    def log(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def base_env(extra: dict[str, str], home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    env.update(extra)
    env["HOME"] = str(home)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def healthcheck(addr: str, service: str = "") -> tuple[int, str]:
    out = subprocess.run([sys.executable, str(HEALTHCHECK), "--addr", addr, "--service", service, "--timeout", "2"],
                         capture_output=True, text=True, timeout=30)
    return out.returncode, out.stdout + out.stderr


@pytest.fixture(scope="module")
def release() -> Rendered:
    return render(VALUES)


@pytest.fixture(scope="module")
def redis_proc(release: Rendered, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, int]]:
    c = container(release.component("redis"))
    env = container_env(release, c)
    args = [_VAR.sub(lambda m: env[m.group(1)], a) for a in c["args"]]
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    tmp = tmp_path_factory.mktemp("redis")
    p = Proc([redis_server_binary() or "redis-server", *args, "--bind", "127.0.0.1"], base_env({}, tmp), tmp)
    try:
        deadline = time.monotonic() + 20
        import redis

        client = redis.Redis(port=port, password=env["REDIS_PASSWORD"], socket_timeout=2)
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or p.proc.poll() is not None:
                    msg = "redis-server did not start with the rendered arguments:\n" + p.log()
                    raise AssertionError(msg) from None
                time.sleep(0.05)
        client.close()
        yield p, port
    finally:
        p.stop()


def test_release_runs(release: Rendered, redis_proc: tuple[Proc, int], tmp_path: Path) -> None:
    import redis

    from hicache.client import HiCacheClient

    _, redis_port = redis_proc
    secrets = release.secret_data()
    token, password = secrets["auth-token"], secrets["redis-password"]
    (cm,) = release.kinds("ConfigMap")
    (tmp_path / "hicache.yaml").write_text(cm["data"]["hicache.yaml"])
    (tmp_path / "router.yaml").write_text(cm["data"]["router.yaml"])

    # --- the node, as its pod runs it -------------------------------------------------------------------
    nc = container(release.component("node"))
    env = container_env(release, nc)
    env["HICACHE_STORAGE__URL"] = re.sub(r"@[^/?]+", f"@127.0.0.1:{redis_port}", env["HICACHE_STORAGE__URL"])
    assert env["HICACHE_STORAGE__URL"] == f"redis://:{password}@127.0.0.1:{redis_port}"
    args = [str(tmp_path / "hicache.yaml") if a == "/etc/hicache/hicache.yaml" else a for a in nc["args"]]
    metrics_port = free_port()
    node = Proc([sys.executable, "-m", "hicache.cli", *args, "--host", "127.0.0.1", "--port", "0",
                 "--metrics-port", str(metrics_port)], base_env(env, tmp_path), tmp_path)
    router: Proc | None = None
    try:
        line = node.wait_for("hicache serve: listening on")
        node_addr = f"127.0.0.1:{int(line.split()[4].rsplit(':', 1)[1])}"

        # probes: what Docker's HEALTHCHECK and the readiness probe ask
        from hicache.service.server import SERVICE_NAME

        readiness = nc["readinessProbe"]["grpc"]["service"]
        assert readiness == SERVICE_NAME
        for service in ("", readiness):
            rc, out = healthcheck(node_addr, service)
            assert rc == 0 and "SERVING" in out, out
        rc, out = healthcheck(f"127.0.0.1:{free_port()}")
        assert rc == 1 and "UNREACHABLE" in out

        # /metrics where the scrape annotations point
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert "hicache_" in body

        # pages committed through the node reach the bundled Redis (URL + password from the Secret)
        prompts = [np.random.default_rng(i).integers(0, 30_000, 8 * PS).astype(np.uint32) for i in range(3)]
        with HiCacheClient(node_addr, token=token) as client:
            committed = 0
            for i, toks in enumerate(prompts):
                rid = f"r{i}"
                m = client.match(toks, rid)
                new = client.allocate(rid, m.num_pages - m.l1_pages)
                committed += client.commit(rid, toks, np.concatenate([m.device_indices, new])).new_pages
                client.release(rid)
        assert committed == 3 * 8
        with HiCacheClient(node_addr, token="wrong", timeout_s=5) as bad, pytest.raises(grpc.RpcError) as err:
            bad.stats()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # --- the router, as its pod runs it -----------------------------------------------------------------
        rcont = container(release.component("router"))
        rargv = [*rcont.get("command", []), *rcont["args"]]
        rargv = [str(tmp_path / "router.yaml") if a == "/etc/hicache/router.yaml" else a for a in rargv]
        rargv = [re.sub(r"^--node=([^=]+)=.*$", rf"--node=\1={node_addr}", a) for a in rargv]
        assert rargv[0] == "route" and any(a.startswith("--node=") for a in rargv)
        router = Proc([sys.executable, "-m", "hicache.cli", *rargv, "--host", "127.0.0.1", "--port", "0",
                       "--metrics-port", "0"], base_env(container_env(release, rcont), tmp_path), tmp_path)
        rline = router.wait_for("hicache route: listening on")
        router_addr = f"127.0.0.1:{int(rline.split()[4].rsplit(':', 1)[1])}"
        ready_service = rcont["readinessProbe"]["grpc"]["service"]
        deadline = time.monotonic() + 20
        while True:  # the router is ready once it reached the node with the token from the Secret
            rc, out = healthcheck(router_addr, ready_service)
            if rc == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert rc == 0, out + router.log()
        assert router.stop() == 0
        router = None
    finally:
        if router is not None:
            router.stop()
        node_rc = node.stop()
    assert node_rc == 0, node.log()
    log = node.log()
    assert "NOT written" not in log, log
    store = redis.Redis(port=redis_port, password=password, socket_timeout=2)
    try:
        assert store.dbsize() == committed
    finally:
        store.close()
