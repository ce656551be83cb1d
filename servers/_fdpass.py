"""Receiving the shared-memory segments of workers on the server's host.

A worker creates a segment as a memfd sealed against shrinking and growing,
and sends its file descriptor over this server's abstract Unix socket
(SCM_RIGHTS) with a random cookie. The Attach RPC, which is authenticated
like every RPC, then names the cookie to map the segment for the worker's
rank in its job incarnation. No file name is ever shared, so no other
process can open, resize or replace a segment.

Descriptors that no Attach claims within `FD_TTL` are closed, and at most
`MAX_PENDING` wait at once.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time

from . import _wire

log = logging.getLogger("jaxps.server")

#: Seconds a received descriptor waits for its Attach.
FD_TTL = 30.0
#: Most received descriptors waiting for their Attach.
MAX_PENDING = 256
#: Seconds a connection has to send its descriptor.
SEND_TIMEOUT = 2.0


class FdInbox:
    """An abstract Unix socket that takes segments' file descriptors.

    Args:
      name: the socket's abstract name (unique per server process).
    """

    def __init__(self, name: str):
        self.address = "\0" + name
        self._sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC
        )
        self._sock.bind(self.address)
        self._sock.listen(64)
        self._pending: collections.OrderedDict[bytes, tuple[int, float]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_loop, name="jaxps-shm-inbox", daemon=True
        )
        self._thread.start()

    @property
    def name(self) -> str:
        """The socket's name for HelloReply (without the leading NUL)."""
        return self.address[1:]

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                self._receive(conn)

    def _receive(self, conn: socket.socket) -> None:
        conn.settimeout(SEND_TIMEOUT)
        try:
            cookie, fds, _, _ = socket.recv_fds(conn, _wire.SHM_COOKIE_BYTES, 1)
        except OSError:
            return
        if len(cookie) != _wire.SHM_COOKIE_BYTES or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return
        now = time.monotonic()
        with self._lock:
            self._drop_expired(now)
            while len(self._pending) >= MAX_PENDING:
                _, (old, _) = self._pending.popitem(last=False)
                os.close(old)
            previous = self._pending.pop(cookie, None)
            if previous is not None:
                os.close(previous[0])
            self._pending[cookie] = (fds[0], now + FD_TTL)
        try:
            conn.sendall(b"\1")
        except OSError:
            pass

    def _drop_expired(self, now: float) -> None:
        for cookie, (fd, expires) in list(self._pending.items()):
            if expires < now:
                del self._pending[cookie]
                os.close(fd)

    def claim(self, cookie: bytes) -> int | None:
        """The descriptor sent with `cookie` (the caller closes it), or
        None if none was, or it expired."""
        with self._lock:
            self._drop_expired(time.monotonic())
            entry = self._pending.pop(bytes(cookie), None)
        return None if entry is None else entry[0]

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            for fd, _ in self._pending.values():
                os.close(fd)
            self._pending.clear()
