"""Options and connections of the Redis L3 backend (:mod:`hicache.storage.redis_backend`): the options
a URL query or keyword arguments set, the hosts and credentials of a URL, and the redis-py client (one
instance or a Sentinel-managed master) or Cluster arguments a URL describes. Nothing here connects."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import ParseResult, unquote, urlencode

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.retry import Retry
from redis.sentinel import Sentinel

from hicache.storage.retry import RetryPolicy
from hicache.storage.threads import check_nice


@dataclass(frozen=True)
class RedisOptions:
    """Options of a Redis URL (query) or keyword arguments: ``prefix`` (key prefix), ``ttl_s`` (expire
    pages; 0 = never), ``touch_on_read`` (reads push the TTL out), ``timeout_s`` (per socket operation),
    ``connect_timeout_s``, ``max_connections`` (a node's pool, and the backend's limit on operations in
    flight), ``retry_attempts`` / ``retry_base_s`` / ``retry_max_s`` (transient errors), ``breaker_base_s``
    / ``breaker_max_s`` (how long a store that failed is left alone before a probe), ``delete_corrupt``
    (drop a page that failed verification), ``hash_threads`` (frame checksums run there, overlapped with
    the socket; writes hash on half as many threads, ``write_nice`` lower in priority), ``sentinel_password``,
    ``ssl_ca_certs`` / ``ssl_certfile`` / ``ssl_keyfile`` / ``ssl_cert_reqs`` (TLS)."""

    prefix: str = "hicache:"
    ttl_s: float = 0.0
    touch_on_read: bool = True
    timeout_s: float = 5.0
    connect_timeout_s: float = 1.0
    max_connections: int = 64
    retry_attempts: int = 3
    retry_base_s: float = 0.02
    retry_max_s: float = 0.5
    breaker_base_s: float = 0.25
    breaker_max_s: float = 5.0
    delete_corrupt: bool = True
    hash_threads: int = 0  # 0: min(8, max(2, cpus))
    write_nice: int = 10  # writes' checksum threads lower their CPU priority by this much (Linux)
    sentinel_password: str = ""
    ssl_ca_certs: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_cert_reqs: str = "required"

    def __post_init__(self) -> None:
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError(f"redis prefix: must not contain braces (hash tags), got {self.prefix!r}")
        if self.ttl_s < 0:
            raise ValueError(f"redis ttl_s: must be >= 0, got {self.ttl_s}")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("redis timeout_s / connect_timeout_s: must be > 0")
        if self.max_connections < 1:
            raise ValueError(f"redis max_connections: must be >= 1, got {self.max_connections}")
        check_nice("redis write_nice", self.write_nice)
        if self.ssl_cert_reqs not in ("required", "optional", "none"):
            raise ValueError(f"redis ssl_cert_reqs: must be required|optional|none, got {self.ssl_cert_reqs!r}")
        RetryPolicy(self.retry_attempts, self.retry_base_s, self.retry_max_s)  # validates

    @classmethod
    def parse(cls, query: Mapping[str, str], kwargs: Mapping[str, Any]) -> tuple[RedisOptions, dict[str, str]]:
        """Options from the URL query (strings) and keyword arguments; returns the unknown query rest."""
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        rest: dict[str, str] = {}
        for k, v in query.items():
            if k in types:
                values[k] = coerce_option(k, v, str(types[k]))
            else:
                rest[k] = v
        for k, v in kwargs.items():
            if k not in types:
                raise ValueError(f"redis: unknown option {k!r}; known: {sorted(types)}")
            values[k] = coerce_option(k, v, str(types[k])) if isinstance(v, str) else v
        return cls(**values), rest


def coerce_option(name: str, v: str, typ: str) -> Any:
    try:
        if typ == "bool":
            if v.lower() in ("1", "true", "yes", "on"):
                return True
            if v.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(v)
        if typ == "int":
            return int(v)
        if typ == "float":
            return float(v)
    except ValueError:
        raise ValueError(f"redis option {name}: cannot read {v!r} as {typ}") from None
    return v


def parse_hosts(netloc: str, default_port: int) -> tuple[str | None, str | None, list[tuple[str, int]]]:
    """``user:pass@h1:p1,h2:p2`` -> (user, password, [(host, port), ...])."""
    user = password = None
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        if ":" in cred:
            u, p = cred.split(":", 1)
            user, password = unquote(u) or None, unquote(p)
        else:
            password = unquote(cred)
    out = []
    for part in netloc.split(","):
        if not part:
            continue
        if part.startswith("["):  # [ipv6]:port
            host, _, port = part[1:].partition("]")
            port = port.lstrip(":")
        else:
            host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
        try:
            out.append((host, int(port) if port else default_port))
        except ValueError:
            raise ValueError(f"redis url: bad port in {part!r}") from None
    if not out:
        raise ValueError("redis url: no host given")
    return user, password, out


def connect(u: ParseResult, o: RedisOptions,
            rest: Mapping[str, str]) -> tuple[redis.Redis | None, dict[str, Any] | None]:
    """The client of a one-instance or Sentinel URL ``u`` (``(client, None)``), or the keyword arguments
    of a ``RedisCluster`` for a Cluster URL (``(None, args)``). ``rest`` is the query left after the
    options, passed on to redis-py for one instance. Raises ValueError for a malformed URL."""
    tls = u.scheme.startswith("rediss")
    conn_kw: dict[str, Any] = dict(
        socket_timeout=o.timeout_s, socket_connect_timeout=o.connect_timeout_s,
        retry=Retry(NoBackoff(), 0), health_check_interval=0)
    if tls:
        conn_kw.update(ssl=True, ssl_cert_reqs=o.ssl_cert_reqs, ssl_ca_certs=o.ssl_ca_certs or None,
                       ssl_certfile=o.ssl_certfile or None, ssl_keyfile=o.ssl_keyfile or None)
    if u.scheme in ("redis", "rediss"):
        base = u._replace(query=urlencode(rest)).geturl()
        kw = {k: v for k, v in conn_kw.items() if not k.startswith("ssl")}
        if tls:
            kw.update(ssl_cert_reqs=o.ssl_cert_reqs, ssl_ca_certs=o.ssl_ca_certs or None,
                      ssl_certfile=o.ssl_certfile or None, ssl_keyfile=o.ssl_keyfile or None)
        pool = redis.ConnectionPool.from_url(base, max_connections=o.max_connections, **kw)
        return redis.Redis(connection_pool=pool), None
    if u.scheme.endswith("+sentinel"):
        user, password, hosts = parse_hosts(u.netloc, 26379)
        parts = [p for p in u.path.split("/") if p]
        if not parts:
            raise ValueError(f"redis url: sentinel URL needs a service name: {u.geturl()!r}")
        service, db = parts[0], int(parts[1]) if len(parts) > 1 else 0
        skw: dict[str, Any] = dict(socket_timeout=o.timeout_s, socket_connect_timeout=o.connect_timeout_s)
        if o.sentinel_password:
            skw["password"] = o.sentinel_password
        sentinel = Sentinel(hosts, sentinel_kwargs=skw, **conn_kw)
        return sentinel.master_for(service, username=user, password=password, db=db,
                                   max_connections=o.max_connections), None
    user, password, hosts = parse_hosts(u.netloc, 6379)  # a Cluster
    return None, dict(startup_nodes=[ClusterNode(h, p) for h, p in hosts], username=user, password=password,
                      max_connections=o.max_connections, **conn_kw)
