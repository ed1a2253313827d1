"""Request validation for the node service.

Every check runs before the cache is touched, so a rejected call changes nothing. Failures raise
:class:`ServiceError` carrying the gRPC status code and a message naming the field:

* ``INVALID_ARGUMENT``: malformed input -- both or neither token fields, a ``tokens`` length that is not a
  multiple of 4, ids outside ``[0, 2**32)``, empty or oversized sequences, page indices out of range or
  repeated, a page count of 0 or beyond the limit.
* ``FAILED_PRECONDITION``: a namespace naming another model, revision or KV layout than this server's;
  pages not owned by the request; a commit that does not extend the match.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import grpc
import numpy as np

from hicache.keys import MAX_TOKEN_ID, Namespace

MAX_TENANT_BYTES = 256
MAX_ID_BYTES = 128  # a client's request id (a node's Match, a router's Route)
_NS_CACHE_SIZE = 4096
SHOWN_CHARS = 64  # at most this much of a client's string goes back in an error message


class ServiceError(Exception):
    """A request refused with a gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def shown(value: str) -> str:
    """``value`` quoted for an error message, cut to :data:`SHOWN_CHARS` characters. gRPC sends the message
    in a trailer that clients cap (8 KiB by default): echoing a long string whole would turn the refusal
    into a RESOURCE_EXHAUSTED transport error on the client's side, losing the real code and message."""
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def precondition(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message)


def token_bytes(packed: bytes, ids: Sequence[int], max_tokens: int, field: str = "tokens",
                allow_empty: bool = False) -> bytes:
    """The request's token ids as uint32 LE bytes, from exactly one of ``tokens`` / ``token_ids``."""
    if packed and len(ids):
        raise invalid(f"{field}: set either tokens (packed uint32) or token_ids, not both")
    if len(ids):
        n = len(ids)
        if n > max_tokens:
            raise invalid(f"{field}: {n} tokens exceed the limit of {max_tokens}")
        arr = np.fromiter(ids, dtype=np.int64, count=n)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            bad = lo if lo < 0 else hi
            raise invalid(f"{field}: token id {bad} outside [0, {MAX_TOKEN_ID}]")
        return arr.astype("<u4").tobytes()
    if len(packed) % 4:
        raise invalid(f"{field}: packed tokens are {len(packed)} bytes, not a multiple of 4 (uint32 LE)")
    n = len(packed) // 4
    if n > max_tokens:
        raise invalid(f"{field}: {n} tokens exceed the limit of {max_tokens}")
    if n == 0 and not allow_empty:
        raise invalid(f"{field}: empty token sequence")
    return bytes(packed)


class NamespaceResolver:
    """Maps a request's NamespaceRef to a :class:`Namespace` of this server (cached per tenant).

    Empty fields mean "the server's"; a different tenant is its own isolated namespace; any other
    model, revision or layout is refused with FAILED_PRECONDITION (this server's pool cannot hold it).
    """

    def __init__(self, base: Namespace) -> None:
        self.base = base
        self._layout = base.layout.describe()
        self._cache: OrderedDict[str, Namespace] = OrderedDict()

    def resolve(self, tenant: str, model: str, revision: str, layout: str) -> Namespace:
        b = self.base
        if model and model != b.model:
            raise precondition(f"namespace.model: this server serves {b.model!r}, not {shown(model)}")
        if revision and revision != b.revision:
            raise precondition(f"namespace.revision: this server serves revision {b.revision!r}, not {shown(revision)}")
        if layout and layout != self._layout:
            raise precondition(f"namespace.layout: this server's KV layout is {self._layout!r}, not {shown(layout)}")
        if not tenant:
            return b
        if len(tenant.encode()) > MAX_TENANT_BYTES:
            raise invalid(f"namespace.tenant: longer than {MAX_TENANT_BYTES} bytes")
        ns = self._cache.get(tenant)
        if ns is None:
            ns = b.with_tenant(tenant)
            _ = ns.digest
            self._cache[tenant] = ns
            if len(self._cache) > _NS_CACHE_SIZE:
                self._cache.popitem(last=False)
        return ns


def page_indices(values: Sequence[int], num_pages: int, field: str = "device_indices") -> np.ndarray:
    """Page indices as int64, each in ``[0, num_pages)`` and none repeated."""
    arr = np.fromiter(values, dtype=np.int64, count=len(values))
    if len(arr):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= num_pages:
            raise invalid(f"{field}: page index {lo if lo < 0 else hi} outside [0, {num_pages})")
        if len(np.unique(arr)) != len(arr):
            raise invalid(f"{field}: a page index appears twice")
    return arr


def page_count(n: int, limit: int, field: str = "num_pages", minimum: int = 1) -> int:
    if n < minimum:
        raise invalid(f"{field}: must be >= {minimum}, got {n}")
    if n > limit:
        raise invalid(f"{field}: {n} pages exceed the limit of {limit}")
    return n
