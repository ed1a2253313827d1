"""Service addresses as users type them: ``host:port``, the one form ``hicache status`` and ``hicache route``
(its ``--node`` flags, ``router.nodes``) accept, checked the same way before any connection is tried.

* ``host`` is a host name or IPv4 address (letters, digits, ``.``, ``-``, ``_``), or an IPv6 address in
  brackets: ``[::1]:50051`` (without them the last colon is ambiguous);
* ``port`` is a decimal number in 1-65535 (0 asks the OS for any free port: a server's choice, never a
  place to connect to);
* an optional ``grpc://`` in front is dropped; any other scheme (``http://``) is refused.

:func:`parse_address` raises :class:`AddressError`, whose message says what is wrong without repeating
the text, so each caller can say where the text came from (a flag, a config field).
"""

from __future__ import annotations

import ipaddress
import re

SCHEME = "grpc://"
PORT_RANGE = "port 1-65535"
_HOST_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class AddressError(ValueError):
    """Not a usable ``host:port``; the message says why."""


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (or ``grpc://host:port``) -> ``(host, port)``; IPv6 hosts keep their brackets, so
    ``f"{host}:{port}"`` is a gRPC target again. Raises :class:`AddressError`."""
    addr = text.strip()
    if not addr:
        raise AddressError("empty")
    if addr.startswith(SCHEME):
        addr = addr[len(SCHEME):]
    elif "://" in addr:
        raise AddressError(f"{addr.partition('://')[0]}:// is not an address scheme here (only {SCHEME})")
    host, colon, port = addr.rpartition(":")
    if not colon:
        raise AddressError("no port")
    if not port:
        raise AddressError("empty port")
    if not (port.isascii() and port.isdigit()):
        raise AddressError(f"port {port!r} is not a number")
    if not 0 < int(port) < 65536:
        raise AddressError(f"port {int(port)} is out of range")
    if not host:
        raise AddressError("no host")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise AddressError(f"{host} is not an IPv6 address") from None
    elif ":" in host:
        raise AddressError(f"an IPv6 host needs brackets: [{host}]:{port}")
    elif not _HOST_NAME.match(host):
        raise AddressError(f"host {host!r} is not a host name or IP address")
    return host, int(port)


def normalize_address(text: str) -> str:
    """``text`` as the ``host:port`` gRPC connects to (no scheme, no spaces); raises :class:`AddressError`."""
    host, port = parse_address(text)
    return f"{host}:{port}"
