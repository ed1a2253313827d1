"""A TCP proxy for tests of replies that come late, are lost, or break off mid-way.

Bytes from the client reach the server at once. Bytes from the server reach the client ``lag_s`` seconds after
the proxy got them (0: at once, in order either way), so a call the server answered in time can still run past
its deadline at the client. The server -> client stream of a connection is cut (both sockets closed), as a
network failure would cut it, on demand:

* :meth:`TcpProxy.drop_next_reply`: when the server next sends anything, after ``settle_s`` (so that the call
  has run); counted in ``drops``;
* :meth:`TcpProxy.arm`: on the next connection to carry replies, once ``n`` bytes of them have passed;
* :meth:`TcpProxy.arm_at`: the first time the replies carry ``marker``, before that data is forwarded (the
  server answered, the client never hears of it); these two counted in ``cuts``.

Later connections pass through.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()


class TcpProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.lag_s = 0.0
        self.settle_s = 0.3
        self.drops = 0  # connections cut by drop_next_reply
        self.cuts = 0  # connections cut by arm / arm_at
        self._drop = threading.Event()
        self._cut_after: int | None = None
        self._marker: bytes | None = None
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The proxy as a Redis URL (database 0)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def drop_next_reply(self) -> None:
        self._drop.set()

    def arm(self, n: int) -> None:
        with self._lock:
            self._cut_after = n

    def arm_at(self, marker: bytes) -> None:
        with self._lock:
            self._marker = marker

    def close(self) -> None:
        _close(self._listener, *self._socks)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks += [down, up]
            q: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
            threading.Thread(target=self._forward, args=(down, up), daemon=True).start()
            threading.Thread(target=self._read_back, args=(up, q), daemon=True).start()
            threading.Thread(target=self._write_back, args=(up, down, q), daemon=True).start()

    @staticmethod
    def _forward(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        _close(src, dst)

    @staticmethod
    def _read_back(up: socket.socket, q: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        try:
            while data := up.recv(1 << 16):
                q.put((time.monotonic(), data))
        except OSError:
            pass
        q.put((time.monotonic(), b""))

    def _cut_here(self, data: bytes, sent: int, limit: int | None) -> tuple[int | None, int | None]:
        """(this connection's byte limit, how much of ``data`` to send before cutting; None: all of it)."""
        with self._lock:
            if self._marker is not None and self._marker in data:
                self._marker = None
                self.cuts += 1
                return limit, 0
            if limit is None:
                limit, self._cut_after = self._cut_after, None
            if limit is not None and sent + len(data) >= limit:
                self.cuts += 1
                return limit, limit - sent
        return limit, None

    def _write_back(self, up: socket.socket, down: socket.socket, q: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        sent, limit = 0, None
        while True:
            t, data = q.get()
            if not data:
                break
            wait = t + self.lag_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if self._drop.is_set():
                self._drop.clear()
                time.sleep(self.settle_s)
                self.drops += 1
                break
            limit, part = self._cut_here(data, sent, limit)
            try:
                down.sendall(data if part is None else data[:part])
            except OSError:
                break
            if part is not None:
                break
            sent += len(data)
        _close(up, down)
