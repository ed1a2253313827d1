"""Deleting a damaged Redis page only while it still holds the damaged value read there
(:mod:`hicache.storage.redis_backend`).

Several nodes share the store, and one of them may have written a good copy of the page under the same
key since the read. So the delete is a small Lua script, atomic on the server, one key per call
(``EVALSHA``, sent again as ``EVAL`` where a node answers ``NOSCRIPT``): a string is deleted only if its
length and SHA1 are still those of the value read; a value of another type only while the key still holds
something other than a string. A store that refuses scripts (an ACL without ``@scripting``, ``EVAL``
renamed away) gets the same conditional delete as an optimistic transaction, :func:`watch_delete`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

import redis

from hicache.storage.redis_nodes import NOSCRIPT, Item, int_replies
from hicache.storage.resp import ReplyError, RespReader

log = logging.getLogger(__name__)

# Deletes KEYS[1] only if it still holds the damaged value read there: ARGV[1] its length and ARGV[2] its
# SHA1 (hex) for a string; ARGV[1] == "-1" for a value of another type (deleted while it is not a string).
# Returns how many keys it deleted (0 or 1).
DELETE_DAMAGED = b"""\
local t = redis.call('TYPE', KEYS[1])['ok']
if ARGV[1] == '-1' then
  if t == 'none' or t == 'string' then return 0 end
  return redis.call('DEL', KEYS[1])
end
if t ~= 'string' or redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[1]) then return 0 end
if redis.sha1hex(redis.call('GET', KEYS[1])) ~= ARGV[2] then return 0 end
return redis.call('DEL', KEYS[1])
"""
DELETE_DAMAGED_SHA = hashlib.sha1(DELETE_DAMAGED).hexdigest().encode()
OTHER_TYPE: tuple[int, bytes] = (-1, b"")  # what was read: a value of another type than a string


def fingerprint(*parts: bytes | bytearray | memoryview) -> tuple[int, bytes]:
    """(length, SHA1 hex) of a damaged value as read: what the conditional delete compares."""
    h = hashlib.sha1(usedforsecurity=False)
    for p in parts:
        h.update(p)
    return sum(len(p) for p in parts), h.hexdigest().encode()


def skip_fingerprint(rd: RespReader, n: int, head: bytes | bytearray = b"") -> tuple[int, bytes]:
    """Consume a bulk string's ``n`` bytes and its CRLF, returning their :func:`fingerprint` (``head``: the
    value's first bytes, consumed already)."""
    h = hashlib.sha1(usedforsecurity=False)
    h.update(head)
    buf = memoryview(bytearray(max(1, min(n, 1 << 20))))
    left = n
    while left:
        k = min(left, len(buf))
        rd.readinto(buf[:k])
        h.update(buf[:k])
        left -= k
    rd.expect_crlf()
    return n + len(head), h.hexdigest().encode()


def scripts_refused(e: BaseException) -> bool:
    """The store refuses Lua scripts: ``NOPERM`` (an ACL without ``@scripting``) or an unknown ``EVAL``
    / ``EVALSHA`` (renamed away). A NOPERM for keys or other commands is no refusal of scripts."""
    if not isinstance(e, ReplyError):
        return False
    low = str(e).lower()
    return (e.kind == "NOPERM" or "unknown command" in low) and "eval" in low


def _script_args(cmd: bytes, script: bytes) -> Callable[[Item], tuple[bytes, ...]]:
    """``EVALSHA`` / ``EVAL`` of :data:`DELETE_DAMAGED` for the damaged value read at a page."""
    def one(it: Item) -> tuple[bytes, ...]:
        assert it.damaged is not None
        return cmd, script, b"1", it.rkey, str(it.damaged[0]).encode(), it.damaged[1]
    return one


class Deleter:
    """The node call of conditional deletes (:meth:`node`, per page 1: deleted, 0: left alone). Remembers
    a store that refused scripts (``no_scripts``: logged once, transactions from then on)."""

    def __init__(self) -> None:
        self.no_scripts = False
        self._evalsha = int_replies(_script_args(b"EVALSHA", DELETE_DAMAGED_SHA))
        self._eval = int_replies(_script_args(b"EVAL", DELETE_DAMAGED))

    def _refused(self, e: ReplyError) -> bool:
        if not scripts_refused(e):
            return False
        if not self.no_scripts:
            self.no_scripts = True
            log.warning("redis: the store refuses scripts (%s); damaged pages are deleted through WATCH / "
                        "MULTI instead", e)
        return True

    @staticmethod
    def _transactions(client: redis.Redis, its: list[Item], asking: bool) -> list[int]:
        if asking:  # a slot migrating (a transaction would need ASKING before each command): the key
            return [0] * len(its)  # is left for a later read to find again
        return [watch_delete(client, it) for it in its]

    def node(self, client: redis.Redis, its: list[Item], asking: bool) -> list[int]:
        if self.no_scripts:
            return self._transactions(client, its, asking)
        try:
            out = self._evalsha(client, its, asking)
        except ReplyError as e:
            if not self._refused(e):
                raise
            return self._transactions(client, its, asking)
        again = [j for j, r in enumerate(out) if r == NOSCRIPT]
        if again:  # the node has not cached the script (restarted, flushed, new): EVAL caches it
            rest = [its[j] for j in again]
            try:
                res = self._eval(client, rest, asking)
            except ReplyError as e:
                if not self._refused(e):
                    raise
                res = self._transactions(client, rest, asking)  # (what EVALSHA deleted stays counted)
            for j, r in zip(again, res, strict=True):
                out[j] = r
        return out


def watch_delete(client: redis.Redis, it: Item) -> int:
    """:data:`DELETE_DAMAGED` as an optimistic transaction, for a store without scripts: 1 when the key
    still held the damaged value read (``it.damaged``) and was deleted, else 0 (a value written since is
    left alone, also one written between the check and the delete: ``EXEC`` then fails)."""
    with client.pipeline(transaction=True) as p:
        try:
            p.watch(it.rkey)
            if it.damaged == OTHER_TYPE:  # deleted only while it still holds a value of another type
                kind = p.type(it.rkey)
                same = kind not in (b"none", b"string", "none", "string")
            else:
                try:
                    value = p.get(it.rkey)
                except redis.exceptions.ResponseError:  # WRONGTYPE: something else now
                    value = None
                same = isinstance(value, bytes) and fingerprint(value) == it.damaged
            if not same:
                p.unwatch()
                return 0
            p.multi()
            p.delete(it.rkey)
            return int(p.execute()[0])
        except redis.exceptions.WatchError:  # written meanwhile: not the value read
            return 0
        except redis.exceptions.ResponseError as e:  # MOVED (resharded since the read) and the like
            log.debug("redis: conditional delete of %r skipped: %s", it.rkey, e)
            return 0
