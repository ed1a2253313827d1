"""Local ``redis-server`` processes on free loopback ports: one instance or an N-master Cluster.

Used by the tests, the storage benchmark and anyone who wants a throw-away store::

    with LocalRedis() as r:                 # r.url == "redis://127.0.0.1:<port>/0"
        ...
    with LocalRedisCluster(masters=3) as c: # c.url == "redis+cluster://127.0.0.1:<p1>,..."
        ...
    with LocalRedis() as r, LocalSentinel(r) as s:  # s.url == "redis+sentinel://127.0.0.1:<p>/mymaster/0"
        ...

Servers run without persistence, in a temporary directory that is removed on :meth:`stop` (a
``workdir`` given by the caller is kept). A single
instance can be killed (``kill()``, SIGKILL: the store vanishes mid-run) and started again on the same
port (``start()``). :func:`redis_server_binary` is None when ``redis-server`` is not installed.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A loopback port that is free now (and, for Cluster nodes, whose bus port +10000 is free too)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if cluster_bus and (port + 10000 > 65535 or not _port_free(port + 10000)):
            continue
        return port
    raise RuntimeError("no free loopback port found")


class LocalRedis:
    """One ``redis-server`` on 127.0.0.1; ``extra`` are more ``--option value`` arguments; ``password``
    sets ``requirepass`` (and is used by :meth:`client`)."""

    def __init__(self, port: int | None = None, extra: tuple[str, ...] = (), cluster: bool = False,
                 workdir: Path | None = None, password: str | None = None) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.cluster = cluster
        self.port = port or free_port(cluster_bus=cluster)
        self._own_dir = workdir is None
        self.dir = workdir or Path(tempfile.mkdtemp(prefix=f"hicache-redis-{self.port}-"))
        self.password = password
        self.extra = (*extra, "--requirepass", password) if password else extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log"), "--protected-mode", "no",
                "--proto-max-bulk-len", "1gb", "--client-query-buffer-limit", "1gb"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf"),
                     "--cluster-node-timeout", "2000"]
        args += self.extra  # last: redis-server takes the last value of an option given twice
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        c = self.client()
        try:
            while True:
                try:
                    if c.ping():
                        return self
                except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError):
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.dir / "redis.log")
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")
                time.sleep(0.02)
        finally:
            c.close()

    def kill(self) -> None:
        """SIGKILL the server (the store disappears at once, as in a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start() if self.proc is None else self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


class LocalSentinel:
    """One Sentinel watching ``master`` as ``service`` (quorum 1), for ``redis+sentinel://`` URLs.

    ``options`` are more ``sentinel <option> <service> <value>`` lines, e.g. ``down-after-milliseconds``.
    """

    def __init__(self, master: LocalRedis, service: str = "mymaster", options: dict[str, str] | None = None) -> None:
        self.master = master
        self.service = service
        self.options = dict(options or {})
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"hicache-sentinel-{self.port}-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.service}/0"

    def start(self, timeout_s: float = 10.0) -> LocalSentinel:
        conf = self.dir / "sentinel.conf"
        auth = f"sentinel auth-pass {self.service} {self.master.password}\n" if self.master.password else ""
        more = "".join(f"sentinel {k} {self.service} {v}\n" for k, v in self.options.items())
        conf.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\nprotected-mode no\n"
                        f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 1\n{auth}{more}")
        binary = redis_server_binary()
        assert binary is not None
        self.proc = subprocess.Popen([binary, str(conf), "--sentinel", "--logfile", str(self.dir / "log")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        c = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
        try:
            while True:
                try:
                    if c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service):
                        return self
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis sentinel on port {self.port} did not start")
                time.sleep(0.02)
        finally:
            c.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalSentinel:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


class LocalRedisCluster:
    """``masters`` cluster-enabled servers joined into one Cluster, slots split evenly, each master with
    ``replicas`` replicas (``nodes``: the masters first). ``node_timeout_ms`` is how long a node may be
    unreachable before the others fail it over (2000 ms when None)."""

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int | None = None) -> None:
        if masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        extra = ("--cluster-node-timeout", str(node_timeout_ms)) if node_timeout_ms else ()
        self.replicas = replicas
        self.nodes = [LocalRedis(cluster=True, extra=extra) for _ in range(masters * (1 + replicas))]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{n.port}" for n in self.nodes]

    def start(self, timeout_s: float = 30.0) -> LocalRedisCluster:
        try:
            for n in self.nodes:
                n.start()
            cli = shutil.which("redis-cli")
            if cli is None:
                raise RuntimeError("redis-cli is not installed (it comes with redis-server / redis-tools)")
            subprocess.run([cli, "--cluster", "create", *self.addresses, "--cluster-replicas", str(self.replicas),
                            "--cluster-yes"], check=True, capture_output=True, timeout=timeout_s)
            deadline = time.monotonic() + timeout_s
            while not self._all_ok():
                if time.monotonic() > deadline:
                    raise RuntimeError("redis cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def _all_ok(self) -> bool:
        for n in self.nodes:
            c = n.client()
            try:
                info = c.execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" not in text:
                    return False
            except redis.RedisError:
                return False
            finally:
                c.close()
        return True

    def stop(self) -> None:
        for n in self.nodes:
            with contextlib.suppress(Exception):
                n.stop()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
