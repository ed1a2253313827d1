"""Checks of a server's configuration against this machine, made before anything is built.

A valid configuration can still name a host that does not resolve, a CUDA device the machine does not
have, tiers larger than the memory the machine has, or TLS files that are missing, not PEM, not a
certificate or key OpenSSL can read, or a key of another certificate. Found later, these surface as a
library's own error (a failed bind blamed on the port, an ``AssertionError`` from torch, an allocator's
``Cannot allocate memory``, or the kernel killing the process as the cache fills) that does not name the
setting to fix. Each check here raises :class:`hicache.config.ConfigError` naming the field
(``serve.host``, ``cache.device``, ``cache.l1_tokens``, ``serve.tls_key``, ...); the caller blames an
environment variable that set it (:func:`hicache.config.blame_env`).

:func:`size_tiers` is the rule ``hicache serve`` sizes L1 and L2 by when nothing sets them.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from hicache.config import ConfigError, HiCacheConfig

PEM_MARK = b"-----BEGIN "


def check_host(host: str, field: str) -> None:
    """``host`` resolves to an address (a name the resolver does not know cannot be bound)."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        why = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise ConfigError(f"{field}: cannot resolve {host!r} ({why})", field) from None


def check_pem_file(path: str, field: str) -> None:
    """``path`` is a readable PEM file (a certificate, a key or a CA bundle)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{field}: {path}: {e.strerror or e}", field) from None
    if PEM_MARK not in data:
        raise ConfigError(f"{field}: {path}: not a PEM file (no '-----BEGIN ...' line)", field)


def check_device(device: str) -> None:
    """``cache.device`` exists here: ``cpu``, or a CUDA device this machine has."""
    if not device.startswith("cuda"):
        return
    index = device[len("cuda"):]
    if index and not (index.startswith(":") and index[1:].isdigit()):
        raise ConfigError(f"cache.device: must be 'cpu', 'cuda' or 'cuda:N', got {device!r}", "cache.device")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(f"cache.device: {device!r}, but this machine has no CUDA device (torch sees none)",
                          "cache.device")
    if index and int(index[1:]) >= count:
        raise ConfigError(f"cache.device: {device!r}, but this machine has {count} CUDA device(s): "
                          f"cuda:0 to cuda:{count - 1}", "cache.device")


class _Encrypted(Exception):
    """The key file asks for a passphrase (raised from ``load_cert_chain``'s password callback)."""


def _ssl_reason(e: ssl.SSLError) -> str:
    """OpenSSL's reason, without Python's source location: ``KEY_VALUES_MISMATCH``, ``PEM lib``, ..."""
    return e.reason or str(e.args[1] if len(e.args) > 1 else e).split("] ", 1)[-1].split(" (_ssl.c")[0]


def check_tls(cert: str, key: str, client_ca: str = "", section: str = "serve") -> None:
    """The certificate, key and client CA files load as gRPC's TLS will load them, and the key belongs to the
    certificate: each is a readable PEM file (:func:`check_pem_file`), then OpenSSL (``ssl``) reads the
    certificate chain, the key with it and the CA bundle. One line naming the file and what is wrong."""
    for name, path in (("tls_cert", cert), ("tls_key", key), ("tls_client_ca", client_ca)):
        if path:
            check_pem_file(path, f"{section}.{name}")
    if cert:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert)
        except ssl.SSLError as e:
            raise ConfigError(f"{section}.tls_cert: {cert}: no certificate OpenSSL can read ({_ssl_reason(e)})",
                              f"{section}.tls_cert") from None
    if cert and key:
        def no_passphrase() -> str:
            raise _Encrypted

        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=no_passphrase)
        except _Encrypted:
            raise ConfigError(f"{section}.tls_key: {key}: the key is encrypted (gRPC needs it without a "
                              "passphrase)", f"{section}.tls_key") from None
        except ssl.SSLError as e:
            why = _ssl_reason(e)
            # OpenSSL 3 drops the certificate a key does not match, then finds none assigned
            if why in ("KEY_VALUES_MISMATCH", "KEY_TYPE_MISMATCH", "NO_CERTIFICATE_ASSIGNED"):
                raise ConfigError(f"{section}.tls_key: {key}: this key does not belong to the certificate "
                                  f"in {cert} ({why})", f"{section}.tls_key") from None
            raise ConfigError(f"{section}.tls_key: {key}: no private key OpenSSL can read ({why})",
                              f"{section}.tls_key") from None
    if client_ca:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=client_ca)
        except ssl.SSLError as e:
            raise ConfigError(f"{section}.tls_client_ca: {client_ca}: no CA certificate OpenSSL can read "
                              f"({_ssl_reason(e)})", f"{section}.tls_client_ca") from None


# ---------------------------------------------------------------------------------------------- memory

SHM_DIR = "/dev/shm"  # where POSIX shared memory (the shared L1 pool on the CPU) lives on Linux


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    """Bytes the shared memory file system can still hold, or None where there is none to ask."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def gpu_free_bytes(device: str) -> int | None:
    """Free memory of the CUDA device ``device`` (what ``cudaMemGetInfo`` says), or None when it cannot be
    asked."""
    try:
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    except Exception:  # no driver answer: the allocation will say
        return None


def _l2_pages_held(config: HiCacheConfig) -> int:
    """Pages the L2 buffer holds: at least one (the cache builds one without L2), whole blocks when
    block-first."""
    return _whole_blocks(max(config.l2_pages, 1), _block(config))


def _block(config: HiCacheConfig) -> int:
    from hicache.pool import default_block_pages

    if config.cache.host_layout != "block_first":
        return 1
    return config.cache.host_block_pages or default_block_pages(config.layout.to_layout().bytes_per_layer_piece)


def _whole_blocks(pages: int, block: int) -> int:
    return -(-pages // block) * block


def _asked(config: HiCacheConfig, knob: str, pages: int, page_bytes: int, need: int | None = None) -> str:
    from hicache.pool import format_bytes

    tokens = config.cache.l1_tokens if knob == "l1_tokens" else config.cache.l2_tokens
    need = pages * page_bytes if need is None else need
    return (f"cache.{knob}: {tokens} tokens ({pages} pages of {format_bytes(page_bytes)}) need "
            f"{format_bytes(need)} ({need} bytes)")


def check_memory(config: HiCacheConfig, available: int | None = -1, shm_free: int | None = -1,
                 gpu_free: Callable[[str], int | None] = gpu_free_bytes) -> None:
    """Every tier fits in what this machine has now, checked before any of it is allocated: L1 on the CPU
    and L2 together in the host memory available (:func:`hicache.pool.available_host_memory`, a memory
    cgroup's limit included), the shared L1 pool on the CPU in the shared memory file system too, L1 on a
    GPU in the device's free memory. The refusal names the knob and the largest value that fits.

    ``available`` / ``shm_free`` (-1: ask this machine) and ``gpu_free`` are for tests."""
    from hicache.pool import available_host_memory, format_bytes  # torch: not for the router's start

    layout = config.layout.to_layout()
    page_bytes, page_size = layout.bytes_per_page, config.layout.page_size
    if available == -1:
        available = available_host_memory()
    l1_pages = config.l1_pages
    l1_bytes = l1_pages * page_bytes
    on_cpu = config.cache.device == "cpu"
    if not on_cpu:
        free = gpu_free(config.cache.device)
        if free is not None and l1_bytes > free:
            raise ConfigError(f"{_asked(config, 'l1_tokens', l1_pages, page_bytes)} of memory on "
                              f"{config.cache.device}, but only {format_bytes(free)} is free there; set a smaller "
                              f"cache.l1_tokens (at most {free // page_bytes * page_size})", "cache.l1_tokens")
    if on_cpu and available is not None and l1_bytes > available:
        raise ConfigError(f"{_asked(config, 'l1_tokens', l1_pages, page_bytes)} of host memory for L1 on the "
                          f"cpu device, but only {format_bytes(available)} is available; set a smaller "
                          f"cache.l1_tokens (what is available holds at most {available // page_bytes * page_size})",
                          "cache.l1_tokens")
    if on_cpu and config.serve.shared_pool:
        if shm_free == -1:
            shm_free = shm_free_bytes()
        if shm_free is not None and l1_bytes > shm_free:
            raise ConfigError(f"{_asked(config, 'l1_tokens', l1_pages, page_bytes)} of shared memory for the "
                              f"shared L1 pool, but {SHM_DIR} has only {format_bytes(shm_free)} free; set a smaller "
                              f"cache.l1_tokens (at most {shm_free // page_bytes * page_size}), a larger {SHM_DIR}, "
                              "or serve.shared_pool: false", "cache.l1_tokens")
    l2_bytes = _l2_pages_held(config) * page_bytes
    room = None if available is None else available - (l1_bytes if on_cpu else 0)
    if config.l2_pages and room is not None and l2_bytes > room:  # (no L2 still builds one page)
        block = _block(config)
        fit = max(0, room) // (page_bytes * block) * block * page_size
        beside = f" beside the {format_bytes(l1_bytes)} of L1 on the cpu device" if on_cpu else ""
        asked = _asked(config, "l2_tokens", config.l2_pages, page_bytes, l2_bytes)
        raise ConfigError(f"{asked} of host memory for L2, but only {format_bytes(available or 0)} is available"
                          f"{beside}; set a smaller cache.l2_tokens (what is left holds at most {fit}; 0 disables "
                          "L2)", "cache.l2_tokens")


# Sizing from the machine: when nothing sets cache.l1_tokens / cache.l2_tokens, ``hicache serve`` keeps the
# host tiers to half of the host memory available (the engine, the OS and the page cache need the rest):
# an L1 on the CPU takes at most L1_SHARE of it, L2 the rest of the half. Each is a power of two of pages
# (so the choice does not move with small changes of free memory), never more than the config's default.
L1_SHARE = 1 / 8
HOST_SHARE = 1 / 2


class Sizing(NamedTuple):
    """What :func:`size_tiers` chose."""

    config: HiCacheConfig  # the config with the chosen sizes
    line: str  # one line saying what was chosen and why ("" when both sizes were set)


def _pow2_pages(budget: int, page_bytes: int, cap_pages: int, block: int = 1) -> int:
    pages = max(0, budget) // page_bytes
    if pages < 1:
        return 0
    p = 1 << (pages.bit_length() - 1)
    return min(p, cap_pages) // block * block


def size_tiers(config: HiCacheConfig, given: set[str], available: int | None = -1) -> Sizing:
    """``config`` with ``cache.l1_tokens`` and ``cache.l2_tokens`` sized from this machine where ``given``
    (dotted field names set by a file, the environment or a flag) does not name them: see
    :data:`L1_SHARE` and :data:`HOST_SHARE`. An L1 on a GPU keeps its default (device memory; checked by
    :func:`check_memory`)."""
    from hicache.pool import available_host_memory, format_bytes

    auto_l1, auto_l2 = "cache.l1_tokens" not in given, "cache.l2_tokens" not in given
    if not (auto_l1 or auto_l2):
        return Sizing(config, "")
    if available == -1:
        available = available_host_memory()
    c = config.cache
    if available is None:
        return Sizing(config, f"hicache serve: tiers at their defaults (L1 {c.l1_tokens}, L2 {c.l2_tokens} tokens): "
                              "this machine does not say how much memory is available")
    page_bytes, page_size = config.layout.to_layout().bytes_per_page, config.layout.page_size
    on_cpu = c.device == "cpu"
    l1_tokens, l2_tokens = c.l1_tokens, c.l2_tokens
    if auto_l1 and on_cpu:
        l1_tokens = max(1, _pow2_pages(int(available * L1_SHARE), page_bytes, config.l1_pages)) * page_size
    l1_host = l1_tokens // page_size * page_bytes if on_cpu else 0
    if auto_l2:
        l2_tokens = _pow2_pages(int(available * HOST_SHARE) - l1_host, page_bytes, config.l2_pages,
                                _block(config)) * page_size
    sized = dataclasses.replace(config, cache=dataclasses.replace(c, l1_tokens=l1_tokens, l2_tokens=l2_tokens))

    def tier(name: str, tokens: int, where: str) -> str:
        return f"{name} {tokens} tokens ({format_bytes(tokens // page_size * page_bytes)}{where})"

    chose = [tier("L1", l1_tokens, ", cpu" if on_cpu else f", {c.device}")] if auto_l1 else []
    if auto_l2:
        chose.append(tier("L2", l2_tokens, "") if l2_tokens else "L2 off (no room)")
    rule = []
    if auto_l1:
        rule.append(f"L1 at most 1/{round(1 / L1_SHARE)} of it" if on_cpu else "L1 on the GPU at its default")
    if auto_l2:
        rule.append(f"{'L1 and L2' if on_cpu else 'L2'} at most 1/{round(1 / HOST_SHARE)} of it")
    auto = [(f, d) for f, d, a in (("cache.l1_tokens", c.l1_tokens, auto_l1), ("cache.l2_tokens", c.l2_tokens, auto_l2))
            if a]
    fields = " and ".join(f for f, _ in auto)
    defaults = " / ".join(str(d) for _, d in auto)
    line = (f"hicache serve: {fields} not set: {', '.join(chose)} from the {format_bytes(available)} of host "
            f"memory available ({'; '.join(rule)}; never above the default{'s' * (len(auto) > 1)} {defaults})")
    return Sizing(sized, line)


# ---------------------------------------------------------------------------------------------- timing

_IMPORTED = time.monotonic()


def process_uptime_s() -> float:
    """Seconds since this process started (Linux: from ``/proc``, interpreter start-up and imports
    included); elsewhere since this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        up = float(Path("/proc/uptime").read_text().split()[0])
        age = up - ticks / os.sysconf("SC_CLK_TCK")
        if age >= 0:
            return age
    except (OSError, ValueError, IndexError):
        pass
    return time.monotonic() - _IMPORTED
