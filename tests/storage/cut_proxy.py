"""A TCP proxy in front of a redis-server that can cut a reply short: a connection reset mid-reply."""

from __future__ import annotations

import contextlib
import socket
import threading


class CutProxy:
    """Forwards connections to ``127.0.0.1:port``. After ``arm(n)``, the next connection to carry replies
    has its server -> client stream cut (both sockets closed) once ``n`` bytes have passed."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listen_port = self.listener.getsockname()[1]
        self.cut_after: int | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.listen_port}/0"

    def arm(self, n: int) -> None:
        with self._lock:
            self.cut_after = n

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

    def _pipe(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        sent, limit = 0, None
        try:
            while data := src.recv(1 << 16):
                if replies and limit is None:
                    with self._lock:
                        limit, self.cut_after = self.cut_after, None
                if limit is not None and sent + len(data) >= limit:
                    dst.sendall(data[: limit - sent])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
