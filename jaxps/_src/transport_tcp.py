"""Payloads on the server's data channel: plain TCP, negotiated over gRPC."""

from __future__ import annotations

import logging
import threading
import time

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
    """

    def __init__(self, client, connection: DataConnection, timeline=None):
        super().__init__(client, timeline)
        self.connection = connection
        self._lock = threading.Lock()
        self._closed = False

    def send(self, chunk: Chunk, credit: Credit) -> None:
        pushed = self._span("queue", chunk.queued, chunk)
        conn = self.connection
        if conn is None:
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
        log.warning(
            "jaxps: the data channel of server %s failed (%s); its payloads "
            "go in gRPC messages from now on",
            self.address,
            err,
        )
        threading.Thread(target=conn.close, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        conn, self.connection = self.connection, None
        if conn is not None:
            conn.close()
        super().close()
