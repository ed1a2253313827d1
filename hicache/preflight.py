"""Checks of a server's configuration against this machine, made before anything is built.

A valid configuration can still name a host that does not resolve, a CUDA device the machine does not
have, an L1 larger than the host memory (on a CPU device), or TLS files that are missing or not PEM. Found
later, these surface as a library's own error (a failed bind blamed on the port, an ``AssertionError`` from
torch, an allocator's ``Cannot allocate memory``) that does not name the setting to fix. Each check here
raises :class:`hicache.config.ConfigError` naming the field (``serve.host``, ``cache.device``,
``cache.l1_tokens``, ``serve.tls_cert``, ...); the caller blames an environment variable that set it
(:func:`hicache.config.blame_env`).
"""

from __future__ import annotations

import socket
from pathlib import Path

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


def check_l1_fits(config: HiCacheConfig) -> None:
    """An L1 on the CPU is host memory: refuse one larger than what is available now (as an L2 is refused)."""
    if config.cache.device != "cpu":
        return
    from hicache.pool import available_host_memory, format_bytes

    page_bytes = config.layout.to_layout().bytes_per_page
    need = config.l1_pages * page_bytes
    avail = available_host_memory()
    if avail is not None and need > avail:
        fit = avail // page_bytes * config.layout.page_size
        raise ConfigError(f"cache.l1_tokens: {config.cache.l1_tokens} tokens ({config.l1_pages} pages of "
                          f"{format_bytes(page_bytes)}) need {format_bytes(need)} of host memory for L1 on the "
                          f"cpu device, but only {format_bytes(avail)} is available; set a smaller "
                          f"cache.l1_tokens (what is available holds at most {fit})", "cache.l1_tokens")
