"""A TCP proxy in front of a node, for tests of replies that come late or never.

Bytes from the client reach the node at once. Bytes from the node reach the client ``lag_s`` seconds after
the proxy got them (0: at once, in order either way), so a call the node answered in time can still run
past its deadline at the client. :meth:`LagProxy.drop_next_reply` cuts the connection when the node next
sends anything (after ``settle_s``, so that the call has run), as a network failure mid-call would; later
connections pass through.
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


class LagProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.lag_s = 0.0
        self.settle_s = 0.3
        self.drops = 0  # connections cut by drop_next_reply
        self._drop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def drop_next_reply(self) -> None:
        self._drop.set()

    def close(self) -> None:
        _close(self._listener, *self._socks)

    def __enter__(self) -> LagProxy:
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
            threading.Thread(target=self._read_back, args=(up, down, q), daemon=True).start()
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
    def _read_back(up: socket.socket, down: socket.socket, q: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        try:
            while data := up.recv(1 << 16):
                q.put((time.monotonic(), data))
        except OSError:
            pass
        q.put((time.monotonic(), b""))

    def _write_back(self, up: socket.socket, down: socket.socket, q: queue.SimpleQueue[tuple[float, bytes]]) -> None:
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
            try:
                down.sendall(data)
            except OSError:
                break
        _close(up, down)
