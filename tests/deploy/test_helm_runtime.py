"""The rendered chart runs: Redis, the node and the router started from what Helm rendered.

One release (CPU nodes, bundled Redis with a generated password, auth on) is rendered; then, on loopback:
``redis-server`` with the Redis container's arguments, ``hicache serve`` with the ConfigMap's hicache.yaml
and the node container's environment (Secret values and ``$(VAR)`` expanded as the kubelet does), and
``hicache route`` with router.yaml and the router container's arguments. Only addresses are rewritten
(cluster DNS names -> 127.0.0.1, fixed ports -> free ones). The image's health check script must report
SERVING for both, /metrics must answer, and pages committed through the node must land in that Redis.
A second release with TLS and mTLS on checks the certificate paths the chart wires into node and router.
"""

from __future__ import annotations

import os
import re
import shutil
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


def healthcheck(addr: str, service: str = "", tls_dir: Path | None = None, client_cert: bool = True) -> tuple[int, str]:
    """Runs the image's health check script (Docker HEALTHCHECK, or an exec probe) against ``addr``; with
    ``tls_dir`` over TLS trusting its ca.crt and (``client_cert``) presenting its tls.crt/tls.key."""
    tls = ["--tls-ca", str(tls_dir / "ca.crt")] if tls_dir else []
    if tls_dir and client_cert:
        tls += ["--tls-cert", str(tls_dir / "tls.crt"), "--tls-key", str(tls_dir / "tls.key")]
    out = subprocess.run([sys.executable, str(HEALTHCHECK), "--addr", addr, "--service", service, "--timeout", "2",
                          *tls], capture_output=True, text=True, timeout=30)
    return out.returncode, out.stdout + out.stderr


def wait_healthy(addr: str, service: str, proc: Proc, tls_dir: Path | None = None, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rc, out = healthcheck(addr, service, tls_dir)
        if rc == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(out + proc.log())
        time.sleep(0.2)


def write_configs(release: Rendered, tmp: Path, tls_dir: Path | None = None) -> None:
    """The ConfigMap's files, as mounted under /etc/hicache (TLS paths pointed at ``tls_dir``)."""
    (cm,) = release.kinds("ConfigMap")
    for name, text in cm["data"].items():
        if tls_dir is not None:
            text = text.replace("/etc/hicache/tls", str(tls_dir))
        (tmp / name).write_text(text)


def local_path(arg: str, tmp: Path) -> str:
    return str(tmp / Path(arg).name) if arg.startswith("/etc/hicache/") else arg


def start_node(release: Rendered, tmp: Path, env: dict[str, str]) -> tuple[Proc, str, int]:
    """`hicache serve` with the node container's args and ``env``, on loopback; (proc, address, metrics port)."""
    args = [local_path(a, tmp) for a in container(release.component("node"))["args"]]
    metrics_port = free_port()
    node = Proc([sys.executable, "-m", "hicache.cli", *args, "--host", "127.0.0.1", "--port", "0",
                 "--metrics-port", str(metrics_port)], base_env(env, tmp), tmp)
    line = node.wait_for("hicache serve: listening on")
    return node, f"127.0.0.1:{int(line.split()[4].rsplit(':', 1)[1])}", metrics_port


def start_router(release: Rendered, tmp: Path, node_addr: str) -> tuple[Proc, str]:
    """`hicache route` with the router container's args and environment, its nodes pointed at ``node_addr``."""
    rc = container(release.component("router"))
    argv = [local_path(a, tmp) for a in [*rc.get("command", []), *rc["args"]]]
    argv = [re.sub(r"^--node=([^=]+)=.*$", rf"--node=\1={node_addr}", a) for a in argv]
    assert argv[0] == "route" and any(a.startswith("--node=") for a in argv)
    router = Proc([sys.executable, "-m", "hicache.cli", *argv, "--host", "127.0.0.1", "--port", "0",
                   "--metrics-port", "0"], base_env(container_env(release, rc), tmp), tmp)
    line = router.wait_for("hicache route: listening on")
    return router, f"127.0.0.1:{int(line.split()[4].rsplit(':', 1)[1])}"


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


@pytest.mark.redis
@pytest.mark.skipif(redis_server_binary() is None, reason="redis-server not installed")
def test_release_runs(release: Rendered, redis_proc: tuple[Proc, int], tmp_path: Path) -> None:
    import redis

    from hicache.client import HiCacheClient
    from hicache.service.server import SERVICE_NAME

    _, redis_port = redis_proc
    secrets = release.secret_data()
    token, password = secrets["auth-token"], secrets["redis-password"]
    write_configs(release, tmp_path)
    nc = container(release.component("node"))
    env = container_env(release, nc)
    env["HICACHE_STORAGE__URL"] = re.sub(r"@[^/?]+", f"@127.0.0.1:{redis_port}", env["HICACHE_STORAGE__URL"])
    assert env["HICACHE_STORAGE__URL"] == f"redis://:{password}@127.0.0.1:{redis_port}"
    node, node_addr, metrics_port = start_node(release, tmp_path, env)
    router: Proc | None = None
    try:
        # probes: what Docker's HEALTHCHECK and the readiness probe ask
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

        # the router is ready once it reached the node with the token from the Secret
        router, router_addr = start_router(release, tmp_path, node_addr)
        wait_healthy(router_addr, container(release.component("router"))["readinessProbe"]["grpc"]["service"],
                     router)
        assert router.stop() == 0
        router = None
    finally:
        if router is not None:
            router.stop()
        node_rc = node.stop()
    assert node_rc == 0, node.log()
    assert "NOT written" not in node.log(), node.log()
    store = redis.Redis(port=redis_port, password=password, socket_timeout=2)
    try:
        assert store.dbsize() == committed
    finally:
        store.close()


def make_certs(d: Path) -> None:
    """A CA and one certificate for 127.0.0.1 usable as server and client (the chart reuses tls.crt for the
    router's mTLS towards the nodes), laid out like a kubernetes.io/tls Secret: tls.crt, tls.key, ca.crt."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=node")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                               "extendedKeyUsage=serverAuth,clientAuth\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "tls.crt", "-days", "2", "-extfile", "ext.cnf")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_release_runs(tmp_path: Path) -> None:
    """tls.enabled + mtls: the node serves TLS from the mounted Secret and requires client certificates; the
    router reaches it with the paths the chart put in router.yaml (CA + client pair) and the token."""
    release = render({**VALUES, "redis": {"enabled": False},
                      "tls": {"enabled": True, "secretName": "node-tls", "mtls": True}})
    tls_dir = tmp_path / "tls"
    tls_dir.mkdir()
    make_certs(tls_dir)
    write_configs(release, tmp_path, tls_dir)
    node, node_addr, _ = start_node(release, tmp_path, container_env(release, container(release.component("node"))))
    router: Proc | None = None
    try:
        rc, out = healthcheck(node_addr)  # plaintext against a TLS port
        assert rc == 1, out
        rc, out = healthcheck(node_addr, tls_dir=tls_dir, client_cert=False)  # mTLS: no client certificate
        assert rc == 1, out
        wait_healthy(node_addr, "", node, tls_dir=tls_dir)
        router, router_addr = start_router(release, tmp_path, node_addr)
        wait_healthy(router_addr, "hicache.v1.Router", router)
        assert router.stop() == 0
        router = None
    finally:
        if router is not None:
            router.stop()
        assert node.stop() == 0, node.log()
