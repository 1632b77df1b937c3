"""Misbehaving Redis endpoints for fault tests: a server that never answers, a slow proxy."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class SilentServer:
    """Accepts TCP connections and never sends a byte (an overloaded or paused Redis)."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for c in self._conns:
            c.close()
        self._thread.join(timeout=5)


class GatedProxy:
    """Forwards TCP to ``port``; while ``hold()`` is in effect, server replies are held back.

    Models a slow or distant Redis without a clock: a test holds the gate, so
    any call that needs a reply cannot finish until the test releases it.
    """

    def __init__(self, port: int) -> None:
        self._target = port
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._closed = False
        self._socks: list[socket.socket] = []
        self.replies = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._target))
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, gated: bool) -> None:
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                return
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            if gated:
                self._open.wait()
                self.replies += 1
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._closed = True
        self._open.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
