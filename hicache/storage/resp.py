"""Just enough RESP (the Redis protocol) to pipeline page reads and writes without copying pages.

redis-py builds every reply as a fresh ``bytes`` object (and its pure-Python parser copies a large value
several times on the way); for multi-megabyte pages that, not the network, is the bottleneck. The Redis
backend therefore sends its batched commands on a connection borrowed from redis-py's pool (which did the
connect, TLS, AUTH and SELECT) and reads the replies itself with :class:`RespReader`, receiving each
page's payload straight into its host page.

Replies handled: simple strings ``+``, errors ``-`` (raised as :class:`ReplyError`), integers ``:``,
bulk strings ``$`` and the RESP3 null ``_``. Anything else is a protocol error (``ConnectionError``; the
caller drops the connection).
"""

from __future__ import annotations

import socket

CRLF = b"\r\n"


class ReplyError(Exception):
    """The server answered one command with an error (``-ERR ...``, ``-MOVED ...``, ``-OOM ...``)."""

    @property
    def kind(self) -> str:
        return str(self.args[0]).split(" ", 1)[0] if self.args else ""


def pack(*args: bytes) -> bytes:
    """One command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def bulk_head(n: int) -> bytes:
    return b"$%d\r\n" % n


class RespReader:
    """Buffered reply reader over a connected socket (plain or TLS).

    Small replies and bulk headers come from an internal buffer; a large bulk body goes with
    :meth:`readinto` straight from the socket into the caller's memory.
    """

    def __init__(self, sock: socket.socket, bufsize: int = 1 << 16) -> None:
        self._sock = sock
        self._buf = bytearray(bufsize)
        self._view = memoryview(self._buf)
        self._r = 0
        self._w = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not consumed (must be 0 once every reply was read)."""
        return self._w - self._r

    def _fill(self) -> None:
        if self._r == self._w:
            self._r = self._w = 0
        elif self._w == len(self._buf):  # compact
            n = self._w - self._r
            self._buf[:n] = self._buf[self._r : self._w]
            self._r, self._w = 0, n
            if n == len(self._buf):
                raise ConnectionError("redis: reply line longer than the read buffer")
        got = self._sock.recv_into(self._view[self._w :])
        if got == 0:
            raise ConnectionError("redis: connection closed by the server")
        self._w += got

    def readline(self) -> bytes:
        """One protocol line without its CRLF."""
        while True:
            i = self._buf.find(CRLF, self._r, self._w)
            if i >= 0:
                line = bytes(self._buf[self._r : i])
                self._r = i + 2
                return line
            self._fill()

    def readinto(self, dst: memoryview) -> None:
        """Exactly ``len(dst)`` bytes into ``dst`` (buffered bytes first, the rest from the socket)."""
        n = len(dst)
        take = min(n, self._w - self._r)
        if take:
            dst[:take] = self._view[self._r : self._r + take]
            self._r += take
        off = take
        while off < n:
            if n - off < 4096:  # small tail: through the buffer (fewer syscalls)
                self._fill()
                take = min(n - off, self._w - self._r)
                dst[off : off + take] = self._view[self._r : self._r + take]
                self._r += take
                off += take
                continue
            got = self._sock.recv_into(dst[off:])
            if got == 0:
                raise ConnectionError("redis: connection closed by the server")
            off += got

    def skip(self, n: int) -> None:
        while n > 0:
            if self._r == self._w:
                self._fill()
            take = min(n, self._w - self._r)
            self._r += take
            n -= take

    def expect_crlf(self) -> None:
        tail = bytearray(2)
        self.readinto(memoryview(tail))
        if tail != CRLF:
            raise ConnectionError("redis: protocol error (bulk string not followed by CRLF)")

    def read_head(self) -> tuple[int, bytes]:
        """First line of a reply: (type byte, rest). Raises :class:`ReplyError` for ``-`` replies."""
        line = self.readline()
        if not line:
            raise ConnectionError("redis: protocol error (empty reply line)")
        t = line[0]
        if t == 0x2D:  # '-'
            raise ReplyError(line[1:].decode("utf-8", "replace"))
        return t, line[1:]

    def read_bulk_len(self) -> int:
        """Head of a bulk-string reply: its length, or -1 for null."""
        t, rest = self.read_head()
        if t == 0x24:  # '$'
            return int(rest)
        if t == 0x5F:  # '_' RESP3 null
            return -1
        raise ConnectionError(f"redis: protocol error (expected a bulk string, got {chr(t)!r})")

    def read_int(self) -> int:
        t, rest = self.read_head()
        if t != 0x3A:  # ':'
            raise ConnectionError(f"redis: protocol error (expected an integer, got {chr(t)!r})")
        return int(rest)

    def read_simple(self) -> bytes:
        """A status (``+OK``), a null (``$-1`` / ``_``: returns b"") or a small bulk string."""
        t, rest = self.read_head()
        if t == 0x2B:  # '+'
            return rest
        if t == 0x5F:
            return b""
        if t == 0x24:
            n = int(rest)
            if n < 0:
                return b""
            out = bytearray(n)
            self.readinto(memoryview(out))
            self.expect_crlf()
            return bytes(out)
        if t == 0x3A:
            return rest
        raise ConnectionError(f"redis: protocol error (unexpected reply type {chr(t)!r})")

    def read_reply_or_error(self) -> bytes | ReplyError:
        """Like :meth:`read_simple`, but an error reply is returned instead of raised."""
        try:
            return self.read_simple()
        except ReplyError as e:
            return e
