"""Open requests by client-chosen id.

A Match opens a :class:`hicache.cache.Request` under an id; Allocate, Prefetch and Commit act on it and
Release closes it. The table is what makes page ownership enforceable: a request owns the L1 prefix it
locked and the pages Allocate gave it, and only its own id reaches them (with a tokens file the servicer
keeps one table per token, so ids are per token too). Calls on one id run one at a time (``Entry.lock``).
Requests idle for longer than ``idle_ttl_s`` (a client that died; :data:`DEFAULT_REQUEST_TTL_S` unless
``hicache serve --request-ttl-s`` says otherwise) are taken out by :meth:`RequestTable.expired` and released
by the servicer's ``expire_idle``, so their locks cannot pin the cache for long. Any call on an id counts as
use: a client that holds a request longer than that without a call (a long decode between Match and
Commit) keeps it with an Allocate of 0 pages now and then. Requests a MatchStream opened are released when
the stream ends, whatever the TTL.

A Match on an open id is refused (ALREADY_EXISTS), except an exact repeat of the Match that opened it
before any other call used the id: a client retrying after the reply was lost (the connection dropped).
:meth:`RequestTable.repeat` finds that entry, and the servicer answers it with the same reply. The
opening request is kept (``Entry.opening``) only until the id's next call, which ends that window.

All methods run on the event loop thread (no locking needed for the dict itself).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from hicache.service.validation import MAX_ID_BYTES, ServiceError, shown

if TYPE_CHECKING:  # the cache (and torch) stay out of what `hicache serve --help` imports
    from hicache.cache import Request

# Seconds a request may idle before it is released. A client that died without its Release holds its L1
# prefix and pages that long (and up to a quarter more: expiry runs every TTL / 4): two minutes, not the
# ten a longer default would let one dead client keep a GPU's pages for.
DEFAULT_REQUEST_TTL_S = 120.0


@dataclass
class Entry:
    request_id: str
    request: Request | None = None  # None while the opening Match is still running
    opening: Any = None  # the MatchRequest that opened the id, until another call uses it (see repeat)
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Set once the opening Match is over, opened or failed (on the event loop thread): a repeat of it waits
    # on this instead of polling.
    settled: asyncio.Event = field(default_factory=asyncio.Event)


class RequestTable:
    def __init__(self, idle_ttl_s: float = DEFAULT_REQUEST_TTL_S) -> None:
        self.idle_ttl_s = idle_ttl_s
        self._entries: dict[str, Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def reserve(self, request_id: str) -> Entry:
        """Claim ``request_id`` for a Match about to run (ALREADY_EXISTS when it is open)."""
        if len(request_id.encode()) > MAX_ID_BYTES:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: longer than {MAX_ID_BYTES} bytes")
        if request_id in self._entries:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r}: already open")
        e = Entry(request_id)
        self._entries[request_id] = e
        return e

    def repeat(self, request_id: str, request: Any) -> Entry | None:
        """The entry that ``request`` (a MatchRequest naming ``request_id``) repeats exactly, if it was opened
        by the same request and no other call has used it since; ``None`` otherwise. The entry's
        ``request`` is still ``None`` while that first Match runs."""
        e = self._entries.get(request_id)
        if e is None or e.opening is None or e.opening != request:
            return None
        e.last_used = time.monotonic()
        return e

    def drop(self, request_id: str) -> None:
        e = self._entries.pop(request_id, None)
        if e is not None:
            e.settled.set()

    def get(self, request_id: str) -> Entry:
        """The open entry for ``request_id`` (NOT_FOUND when unknown or released)."""
        if not request_id:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required")
        e = self._entries.get(request_id)
        if e is None or e.request is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND,
                               f"request_id {shown(request_id)}: no open request (never matched, or already released)")
        e.last_used = time.monotonic()
        e.opening = None  # the id is in use now: a Match naming it again is a conflict, not a retry
        return e

    def pop(self, request_id: str) -> Entry:
        e = self.get(request_id)
        del self._entries[request_id]
        return e

    def take_open(self, request_id: str) -> Entry | None:
        """Remove and return the entry of ``request_id`` if its request is open; ``None`` (and nothing
        removed) when the id is unknown or its Match is still opening it."""
        e = self._entries.get(request_id)
        if e is None or e.request is None:
            return None
        del self._entries[request_id]
        return e

    def pending(self, request_id: str) -> Entry | None:
        """The entry of ``request_id`` while its Match is still opening it (``request`` None); else ``None``."""
        e = self._entries.get(request_id)
        return e if e is not None and e.request is None else None

    def take_entry(self, entry: Entry) -> bool:
        """Remove ``entry`` if it is still the open entry of its id (not dropped, nor released and its id
        reused since); True when removed."""
        if self._entries.get(entry.request_id) is not entry or entry.request is None:
            return False
        del self._entries[entry.request_id]
        return True

    def expired(self, now: float | None = None) -> list[Entry]:
        """Remove and return the entries idle for longer than the TTL (their requests are still open). An
        entry whose Match has not settled yet is not idle (its worker may have opened the request already)."""
        now = time.monotonic() if now is None else now
        old = [e for e in self._entries.values()
               if e.request is not None and e.settled.is_set() and not e.lock.locked()
               and now - e.last_used > self.idle_ttl_s]
        for e in old:
            del self._entries[e.request_id]
        return old

    def drain(self) -> list[Entry]:
        """Remove and return every entry (shutdown): the open ones, and those whose Match is still opening
        them (``request`` None until it has; ``settled`` once it is over)."""
        out = list(self._entries.values())
        self._entries.clear()
        return out
