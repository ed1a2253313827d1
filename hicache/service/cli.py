"""``hicache serve``: run the node service.

    hicache serve --config node.yaml [--port 50051] [--metrics-port 9400] [--storage-url file:///var/hicache] ...

Precedence: the YAML file < ``HICACHE_<SECTION>__<FIELD>`` environment variables < flags. The bearer token
is best passed as ``HICACHE_SERVE__AUTH_TOKEN`` (flags show up in ``ps``). Where nothing sets
``cache.l1_tokens`` / ``cache.l2_tokens``, they are sized from this machine (an L1 on the CPU at most 1/8 of
the host memory available, L1 and L2 together at most half, never above the defaults; one line says what was
chosen). Every tier is checked against the memory there is before any is allocated. On start it prints
``hicache serve: listening on HOST:PORT ... after N s``; SIGTERM shuts down gracefully (see :mod:`.server`).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from typing import Any

from hicache.cli import HelpFormatter
from hicache.config import ConfigError, HiCacheConfig, load_config
from hicache.config_load import blame_env, env_sources, read_config_file
from hicache.service.preflight import check_device, check_host, check_memory, check_tls, size_tiers
from hicache.service.requests import DEFAULT_REQUEST_TTL_S

# flag dest -> (section, field)
_FLAGS: dict[str, tuple[str, str]] = {
    "host": ("serve", "host"),
    "port": ("serve", "port"),
    "metrics_port": ("serve", "metrics_port"),
    "max_concurrency": ("serve", "max_concurrency"),
    "max_message_bytes": ("serve", "max_message_bytes"),
    "max_request_tokens": ("serve", "max_request_tokens"),
    "auth_token": ("serve", "auth_token"),
    "tls_cert": ("serve", "tls_cert"),
    "tls_key": ("serve", "tls_key"),
    "tls_client_ca": ("serve", "tls_client_ca"),
    "shutdown_grace_s": ("serve", "shutdown_grace_s"),
    "shared_pool": ("serve", "shared_pool"),
    "storage_url": ("storage", "url"),
    "compression": ("storage", "compression"),
    "device": ("cache", "device"),
    "l1_tokens": ("cache", "l1_tokens"),
    "l2_tokens": ("cache", "l2_tokens"),
    "write_policy": ("cache", "write_policy"),
    "model": ("model", "name"),
    "revision": ("model", "revision"),
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="run the gRPC node service", description=__doc__,
        formatter_class=HelpFormatter)
    p.add_argument("--config", metavar="FILE", help="YAML config (sections model, layout, cache, storage, serve)")
    g = p.add_argument_group("overrides (win over the file and the environment)")
    g.add_argument("--host")
    g.add_argument("--port", type=int)
    g.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0: off)")
    g.add_argument("--max-concurrency", type=int, help="RPCs in flight before RESOURCE_EXHAUSTED")
    g.add_argument("--max-message-bytes", type=int)
    g.add_argument("--max-request-tokens", type=int)
    g.add_argument("--auth-token", help="require 'authorization: Bearer TOKEN' (prefer HICACHE_SERVE__AUTH_TOKEN)")
    g.add_argument("--tls-cert", metavar="PEM")
    g.add_argument("--tls-key", metavar="PEM")
    g.add_argument("--tls-client-ca", metavar="PEM", help="require client certificates signed by this CA (mTLS)")
    g.add_argument("--shutdown-grace-s", type=float)
    g.add_argument("--shared-pool", action=argparse.BooleanOptionalAction, default=None,
                   help="share the L1 pool with clients on this host (shared memory / CUDA IPC)")
    g.add_argument("--storage-url", help="L3 store: memory://, redis://..., file:///path, ... ('' disables)")
    g.add_argument("--compression", help="L3 page compression, lossless: none | zstd | lz4 (default: none)")
    g.add_argument("--device", help="L1 device: cpu | cuda[:N]")
    g.add_argument("--l1-tokens", type=int)
    g.add_argument("--l2-tokens", type=int)
    g.add_argument("--write-policy")
    g.add_argument("--model")
    g.add_argument("--revision")
    p.add_argument("--request-ttl-s", type=float, default=DEFAULT_REQUEST_TTL_S,
                   help="release requests idle this long (a client that went away); default "
                        f"{DEFAULT_REQUEST_TTL_S:g}")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def overrides_from_args(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for dest, (section, name) in _FLAGS.items():
        v = getattr(args, dest, None)
        if v is not None:
            out.setdefault(section, {})[name] = v
    return out


def preflight(config: HiCacheConfig, overrides: dict[str, dict[str, Any]], given: set[str] | None = None
              ) -> tuple[HiCacheConfig, str]:
    """What this machine must offer the config (:mod:`hicache.service.preflight`). Returns the config with each tier
    size that ``given`` (the fields set anywhere; None: all) does not name sized from this machine, and the
    line saying so ("" when none was); :class:`ConfigError` naming the field, or the environment variable
    that set it."""
    s = config.serve
    try:
        check_host(s.host, "serve.host")
        check_device(config.cache.device)
        check_tls(s.tls_cert, s.tls_key, s.tls_client_ca)
        sizing = size_tiers(config, {"cache.l1_tokens", "cache.l2_tokens"} if given is None else given)
        check_memory(sizing.config)  # every tier, before any is allocated
    except ConfigError as e:
        raise blame_env(e, os.environ, overrides) from None
    return sizing


def given_fields(path: str | None, overrides: dict[str, dict[str, Any]]) -> set[str]:
    """``section.field`` names the config file, the environment or a flag sets."""
    data = read_config_file(path) if path is not None else {}
    out = {f"{sec}.{name}" for sec, fields in data.items() if isinstance(fields, dict) for name in fields}
    out |= set(env_sources(os.environ))
    out |= {f"{sec}.{name}" for sec, fields in overrides.items() for name in fields}
    return out


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = overrides_from_args(args)
    config = load_config(args.config, overrides=overrides)
    # NaN passes "> 0" and would keep every abandoned request (and its pages) forever, as inf says to
    if not (math.isfinite(args.request_ttl_s) and args.request_ttl_s > 0):
        raise ConfigError(f"--request-ttl-s: must be a finite number > 0, got {args.request_ttl_s}")
    config, sized = preflight(config, overrides, given_fields(args.config, overrides))
    if sized:
        print(sized, flush=True)
    from hicache.service.server import run as run_server

    return run_server(config, request_ttl_s=args.request_ttl_s)
