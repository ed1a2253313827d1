"""A TCP proxy that can cut a server's reply short: a connection reset mid-reply, or a reply lost whole."""

from __future__ import annotations

import contextlib
import socket
import threading


class CutProxy:
    """Forwards connections to ``127.0.0.1:port``, server -> client streams cut (both sockets closed) on
    demand: after ``arm(n)``, the next connection to carry replies once ``n`` bytes of them have passed;
    after ``arm_at(marker)``, the first connection whose replies carry ``marker``, before that data is
    forwarded (the server answered, the client never hears of it). ``cuts`` counts the cuts made."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listen_port = self.listener.getsockname()[1]
        self.cut_after: int | None = None
        self.marker: bytes | None = None
        self.cuts = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.listen_port}/0"

    def arm(self, n: int) -> None:
        with self._lock:
            self.cut_after = n

    def arm_at(self, marker: bytes) -> None:
        with self._lock:
            self.marker = marker

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.port))
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _cut_here(self, data: bytes) -> bool:
        with self._lock:
            if self.marker is None or self.marker not in data:
                return False
            self.marker = None
            self.cuts += 1
            return True

    def _pipe(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        sent, limit = 0, None
        try:
            while data := src.recv(1 << 16):
                if replies and self._cut_here(data):
                    break
                if replies and limit is None:
                    with self._lock:
                        limit, self.cut_after = self.cut_after, None
                if limit is not None and sent + len(data) >= limit:
                    dst.sendall(data[: limit - sent])
                    with self._lock:
                        self.cuts += 1
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
