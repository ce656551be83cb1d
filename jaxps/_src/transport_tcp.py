"""Payloads on the server's data channel: TCP or TLS, negotiated over gRPC.

A server's data channel that cannot be reached (a firewall, a Service
without the port) or that is lost mid-job does not stop the job: its
chunks go in gRPC messages, one warning names the port and the fix, and
the channel is tried again after `RETRY_FIRST` seconds, doubling up to
`RETRY_MAX`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from jaxps._src import errors
from jaxps._src.datachannel import DataConnection
from jaxps._src.transport import (
    Chunk,
    Credit,
    fingerprint,
    pull_deadline,
)
from jaxps._src.transport_grpc import GrpcTransport

log = logging.getLogger("jaxps")

#: Seconds before a lost data channel is tried again; doubles up to
#: RETRY_MAX after each failed try.
RETRY_FIRST = 5.0
RETRY_MAX = 120.0


class _Spent:
    """The credit of a chunk whose credit already went back."""

    def release(self, nbytes: int) -> None:
        del nbytes

    def may_block(self) -> bool:
        return False

    def unblock(self) -> None:
        pass


class TcpTransport(GrpcTransport):
    """Sends each chunk as one frame on a `DataConnection`; the server
    acknowledges the push (the credit goes back) and later sends the sum,
    which is received straight into the chunk's dest.

    A chunk whose connection broke goes again over gRPC (Push, then Pull):
    the server counts a repeated push once, so this is safe, and a server
    that is really gone is then named by the gRPC path's retry window.
    While there is no connection, chunks go over gRPC and `open` is tried
    again with backoff.

    Args:
      client: the server's gRPC client.
      open: opens a new `DataConnection` (after a new hello); raises
        `ServerUnavailableError` if the port cannot be reached.
      timeline: where spans go, or None.
    """

    def __init__(
        self, client, open: Callable[[], DataConnection], timeline=None
    ):
        super().__init__(client, timeline)
        self._open = open
        self._lock = threading.Lock()
        self._closed = False
        self._retry_at = 0.0
        self._backoff = RETRY_FIRST
        self._opening = False
        self._warned = False
        self.connection: DataConnection | None = None
        try:
            self.connection = open()
        except errors.ServerUnavailableError as err:
            self._lost(err)

    def _lost(self, err: errors.JaxpsError) -> None:
        """No connection from now until the next try (`_retry_at`)."""
        with self._lock:
            self._retry_at = time.monotonic() + self._backoff
            wait, self._backoff = (
                self._backoff,
                min(RETRY_MAX, 2 * self._backoff),
            )
            first, self._warned = not self._warned, True
        (log.warning if first else log.info)(
            "jaxps: %s; its payloads go in gRPC messages, and the data "
            "channel is tried again in %.0f s. Open TCP port %s to the "
            "server (jaxps-server --data-port fixes it), or set "
            "JAXPS_TRANSPORT=grpc to not use the data channel.",
            err,
            wait,
            self.client.data_port,
        )

    def _maybe_reopen(self) -> None:
        """Starts one try to open the data channel again, if it is time."""
        with self._lock:
            if (
                self._closed
                or self._opening
                or time.monotonic() < self._retry_at
            ):
                return
            self._opening = True
        threading.Thread(
            target=self._reopen, name="jaxps-data-reopen", daemon=True
        ).start()

    def _reopen(self) -> None:
        try:
            conn = self._open()
        except errors.JaxpsError as err:
            self._lost(err)
        else:
            with self._lock:
                closed = self._closed
                if not closed:
                    self.connection = conn
                    self._backoff = RETRY_FIRST
            if closed:
                conn.close()
            else:
                log.info("jaxps: data channel of %s open again", self.address)
        finally:
            with self._lock:
                self._opening = False

    def send(self, chunk: Chunk, credit: Credit) -> None:
        pushed = self._span("queue", chunk.queued, chunk)
        conn = self.connection
        if conn is None:
            self._maybe_reopen()
            self.push_then_pull(chunk, credit, pushed)
            return
        source = chunk.source
        times = {}

        def on_ack():
            credit.release(chunk.nbytes)
            times["pulling"] = self._span("push", pushed, chunk)

        def on_done(err, contributors=0):
            if err is None:
                self._complete(
                    chunk, times["pulling"], lambda: (chunk.dest, contributors)
                )
            elif isinstance(err, errors.ServerUnavailableError):
                self._fall_back(chunk, err)
            else:
                chunk.handle.fail(err)

        try:
            conn.push_pull(
                chunk.header,
                source,
                fingerprint(source),
                chunk.dest,
                time.monotonic() + pull_deadline(self.timeout),
                on_ack,
                on_done,
            )
        except errors.JaxpsError as err:
            # the connection broke before: never sent, the credit is held
            self._drop(conn, err)
            self.push_then_pull(chunk, credit, pushed)

    def _fall_back(self, chunk: Chunk, err: errors.JaxpsError) -> None:
        """Sends a chunk of a broken connection again, over gRPC (on a
        thread of its own: this runs on the connection's reader)."""
        self._drop(self.connection, err)
        threading.Thread(
            target=self._resend,
            args=(chunk, err),
            name="jaxps-data-fallback",
            daemon=True,
        ).start()

    def _resend(self, chunk: Chunk, err: errors.JaxpsError) -> None:
        if self._closed or chunk.handle.failed:
            chunk.handle.fail(err)  # nobody waits for it any more
            return
        try:
            self.push_then_pull(
                chunk, _Spent(), self._span("queue", chunk.queued, chunk)
            )
        except Exception as late:  # noqa: BLE001 - e.g. the channel closed
            chunk.handle.fail(
                errors.ServerUnavailableError(
                    f"{err}; sending it again over gRPC failed: {late!r}"
                )
            )

    def _drop(self, conn: DataConnection | None, err) -> None:
        with self._lock:
            if conn is None or self.connection is not conn:
                return
            self.connection = None
        self._lost(err)
        threading.Thread(target=conn.close, daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conn, self.connection = self.connection, None
        if conn is not None:
            conn.close()
        super().close()
