"""The worker's end of a data channel: chunks on TCP (or TLS) to one server.

A `DataConnection` is opened with the port and nonce of the server's
HelloReply, within `CONNECT_TIMEOUT` (a blocked port is found in seconds,
not at the job's timeout). `push_pull` sends a chunk's header, name and
payload with one ``sendmsg`` straight from the source array (on TLS, one
record for the head and the payload after it); a reader thread takes the
server's answers: an acknowledgement (the push is accepted: credit goes
back) and later the sum, received with one ``recv_into`` straight into the
chunk's output array (a sum in a slot that is ready at once may come
alone, and give the credit back itself). A watchdog fails every request
whose deadline passed and shuts a connection down when it stopped
answering, so nothing waits forever.

`DataTransport` sends a server client's chunks on it. A data channel that
cannot be reached (a firewall, a Service without the port) or that is lost
mid-job does not stop the job: its chunks go in gRPC messages, one warning
names the port and the fix, and the channel is tried again after
`RETRY_FIRST` seconds, doubling up to `RETRY_MAX`.
"""

from __future__ import annotations

import itertools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable

import numpy as np

from jaxps._src import errors
from jaxps._src.plan import Gather
from jaxps._src.transport.base import (
    SPENT,
    Chunk,
    Credit,
    fingerprint,
    parts_of,
    pull_deadline,
)
from jaxps._src.transport.grpc import GrpcTransport
from jaxps.servers import _wire

log = logging.getLogger("jaxps")

#: How often the watchdog looks at the deadlines.
_TICK = 0.25
#: Seconds to connect, finish TLS and the hello of a data connection.
CONNECT_TIMEOUT = 2.0
#: Seconds before a lost data channel is tried again; doubles up to
#: RETRY_MAX after each failed try.
RETRY_FIRST = 5.0
RETRY_MAX = 120.0


class _Request:
    __slots__ = ("header", "dest", "on_ack", "on_done", "deadline", "acked")

    def __init__(self, header, dest, on_ack, on_done, deadline):
        self.header = header
        self.dest = dest
        self.on_ack = on_ack
        self.on_done = on_done
        self.deadline = deadline
        self.acked = False


class DataConnection:
    """One TCP connection to a server's data channel.

    Args:
      address: the server's ``host:port`` (its gRPC address).
      port: the data channel's port, from the HelloReply.
      nonce: the one-time nonce from the same HelloReply.
      rank: this worker's rank.
      job_id: the job id.
      token: the job's shared token, or None.
      incarnation: the server's incarnation id from its HelloReply.
      timeout: seconds to wait for any answer.
      tls: the client side of TLS (`client.tls_context`), or None.
      connect_timeout: seconds to connect and say hello.

    Raises:
      ServerUnavailableError: the port cannot be reached, or the hello
        was not answered, within `connect_timeout`.
    """

    def __init__(
        self,
        address: str,
        port: int,
        nonce: bytes,
        *,
        rank: int,
        job_id: str,
        token: str | None,
        incarnation: str,
        timeout: float,
        tls: ssl.SSLContext | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
    ):
        self.address = address
        self.port = port
        host = address.rpartition(":")[0].strip("[]")
        self.timeout = timeout
        connect_timeout = min(connect_timeout, timeout)
        try:
            self.sock = socket.create_connection((host, port), connect_timeout)
            if tls is not None:
                self.sock = tls.wrap_socket(self.sock, server_hostname=host)
        except OSError as err:
            raise errors.ServerUnavailableError(
                f"server {address}: cannot open its data channel on port "
                f"{port} within {connect_timeout:g} s: {err}"
            ) from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, _wire.DATA_SNDBUF
        )
        self._pending: dict[int, _Request] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._broken: errors.JaxpsError | None = None
        self._heard = time.monotonic()
        try:
            self._handshake(nonce, rank, job_id, token, incarnation)
        except BaseException:
            self.sock.close()
            raise
        self.sock.settimeout(None)
        self._reader = threading.Thread(
            target=self._read_loop, name="jaxps-data-read", daemon=True
        )
        self._reader.start()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(
            target=self._watch, name="jaxps-data-watch", daemon=True
        )
        self._watchdog.start()

    def _handshake(self, nonce, rank, job_id, token, incarnation) -> None:
        mac = _wire.data_mac(token, nonce, rank, job_id)
        hello = _wire.DATA_HELLO.pack(
            _wire.DATA_MAGIC, _wire.PROTOCOL_VERSION, rank, nonce, mac
        )
        try:
            self.sock.sendall(hello)
            head = memoryview(bytearray(_wire.DATA_REPLY.size))
            _wire.recv_exact(self.sock, head)
            kind, status, _, _, size = _wire.DATA_REPLY.unpack(head)
            body = bytearray(min(size, _wire.DATA_MAX_TEXT))
            _wire.recv_exact(self.sock, memoryview(body))
        except (OSError, ConnectionError) as err:
            raise errors.ServerUnavailableError(
                f"server {self.address}: data channel handshake failed: {err}"
            ) from None
        text = body.decode(errors="replace")
        if kind != _wire.DATA_OK:
            raise self._error(status, text, "data channel handshake")
        if text != incarnation:
            raise errors.ServerRestartedError(
                f"server {self.address} restarted while its data channel "
                "was opened; restart the job."
            )

    # -- requests --------------------------------------------------------

    def push_pull(
        self,
        header,
        source: np.ndarray | Gather,
        checksum: int,
        dest: np.ndarray,
        deadline: float,
        on_ack: Callable[[], None],
        on_done: Callable[..., None],
        slot=None,
    ) -> None:
        """Sends one chunk; calls `on_ack()` once the server accepted it
        and `on_done(None, contributors)` once its sum (over `contributors`
        ranks; 0: not said) is in `dest`, or `on_done(error)` if it failed.
        With a `slot` (a `pb.ShmSlot` of shared memory the server attached)
        the payload is there, not in `source`, and the sum goes there, not
        in `dest` (both None). Raises if the connection is broken."""
        if self._broken is not None:
            raise self._broken
        rid = next(self._ids) & 0xFFFFFFFF
        op = _wire.DATA_OP_PUSH_PULL
        if header.check_key:  # a piece that carries its call's check
            op = _wire.DATA_OP_PUSH_PULL_CHECKED
            name = _wire.encode_carrier_name(header)
        elif header.signature:  # a call check
            op = _wire.DATA_OP_CHECK
            name = _wire.encode_check_name(
                header.signature, header.name, header.description
            )
        else:
            name = header.name.encode()[: _wire.DATA_MAX_TEXT - 1]
        if slot is not None:
            op |= _wire.DATA_OP_IN_SLOT
            body = (_wire.DATA_SLOT.pack(slot.segment, slot.offset),)
        else:
            body = parts_of(source)
        head = _wire.DATA_REQUEST.pack(
            op,
            header.dtype,
            len(name),
            header.rank,
            header.key,
            header.round,
            header.length,
            checksum,
            rid,
            max(0.0, deadline - time.monotonic()),
        )
        with self._lock:
            if self._broken is not None:
                raise self._broken
            self._pending[rid] = _Request(
                header, dest, on_ack, on_done, deadline
            )
        try:
            with self._send_lock:
                _wire.send_frame(self.sock, head + name, *body)
        except OSError as err:
            self._fail_all(
                errors.ServerUnavailableError(
                    f"server {self.address}: data channel send failed: {err}"
                )
            )

    # -- answers ---------------------------------------------------------

    def _read_loop(self) -> None:
        head = memoryview(bytearray(_wire.DATA_REPLY.size))
        try:
            while True:
                _wire.recv_exact(self.sock, head)
                self._heard = time.monotonic()
                kind, status, count, rid, size = _wire.DATA_REPLY.unpack(head)
                with self._lock:
                    req = self._pending.get(rid)
                # A request leaves `_pending` only once its answer is read
                # whole: if the connection dies halfway, `_fail_all` ends it.
                if kind == _wire.DATA_ACK:
                    if req is not None:
                        self._ack(req)
                elif kind == _wire.DATA_SUM:
                    self._sum(rid, req, size, count)
                elif kind == _wire.DATA_ERROR:
                    if size > _wire.DATA_MAX_TEXT:
                        raise self._violation(f"an error of {size} bytes")
                    body = bytearray(size)
                    _wire.recv_exact(self.sock, memoryview(body))
                    err = self._error(
                        status, body.decode(errors="replace"), req
                    )
                    if rid == 0:
                        raise err  # about the connection itself
                    if req is not None:  # else: late, its request ended
                        self._end(rid, err)
                else:
                    raise self._violation(f"a frame of unknown kind {kind}")
        except (OSError, ConnectionError) as err:
            if self._stop.is_set():
                err = errors.JaxpsError("the data connection was closed")
            self._fail_all(
                errors.ServerUnavailableError(
                    f"server {self.address}: data channel lost: {err}"
                )
                if not isinstance(err, errors.JaxpsError)
                else err
            )
        except errors.JaxpsError as err:
            self._fail_all(err)
        except Exception as err:  # noqa: BLE001 - a bug must not hang chunks
            self._fail_all(
                errors.ServerUnavailableError(
                    f"server {self.address}: data channel reader failed: "
                    f"{err!r}"
                )
            )

    def _violation(self, what: str) -> errors.ServerUnavailableError:
        """The connection's end: the server sent `what`, which the protocol
        does not allow (its chunks go again over gRPC)."""
        return errors.ServerUnavailableError(
            f"server {self.address}: data channel protocol violation: {what}"
        )

    def _sum(
        self, rid: int, req: _Request | None, size: int, contributors: int
    ) -> None:
        if req is not None and req.dest is None:  # the sum is in its slot
            if size:
                raise self._violation(f"a sum of {size} bytes for a slot")
            self._end(rid, None, contributors)
            return
        if req is None or size != req.dest.nbytes:
            # a request that already failed (deadline), or a wrong size:
            # read the bytes off the stream
            _wire.recv_exact(self.sock, memoryview(bytearray(size)))
            if req is not None:
                self._end(
                    rid,
                    errors.RequestRejectedError(
                        f"server {self.address} answered {req.header.name} "
                        f"round {req.header.round} with {size} bytes, "
                        f"expected {req.dest.nbytes}."
                    ),
                )
            return
        _wire.recv_exact(
            self.sock, memoryview(req.dest.reshape(-1).view(np.uint8))
        )
        self._end(rid, None, contributors)

    def _ack(self, req: _Request) -> None:
        """Gives a request's credit back, once (the reader, the watchdog
        and `_fail_all` may all try)."""
        with self._lock:
            first, req.acked = not req.acked, True
        if first:
            req.on_ack()

    def _end(
        self, rid: int, err: BaseException | None, contributors: int = 0
    ) -> None:
        """Ends request `rid` if it is still pending (else the watchdog or
        `_fail_all` ended it already)."""
        with self._lock:
            req = self._pending.pop(rid, None)
        if req is not None:
            self._finish(req, err, contributors)

    def _finish(
        self, req: _Request, err: BaseException | None, contributors: int = 0
    ) -> None:
        self._ack(req)  # a sum implies the push was accepted
        if err is None:
            req.on_done(None, contributors)
        else:
            req.on_done(err)

    def _error(self, status: int, text: str, req) -> errors.JaxpsError:
        code = (
            _wire.STATUS_CODES[status]
            if status < len(_wire.STATUS_CODES)
            else f"status {status}"
        )
        where = f"server {self.address}"
        if isinstance(req, _Request):
            h = req.header
            where += f" (push_pull of {h.name} round {h.round})"
        elif isinstance(req, str):
            where += f" ({req})"
        if code == "DEADLINE_EXCEEDED":
            return errors.RoundTimeoutError(f"{where}: {text}")
        if code in _wire.REJECTED_STATUSES:
            if _wire.MISMATCH_PREFIX in text:  # as ServerClient.translate
                return errors.MismatchError(f"{where}: {text}")
            return errors.RequestRejectedError(
                f"{where} rejected the request ({code}): {text}"
            )
        if code == "UNAVAILABLE":
            return errors.ServerUnavailableError(f"{where}: {text}")
        return errors.JaxpsError(f"{where} failed ({code}): {text}")

    def _fail_all(self, err: errors.JaxpsError) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = err
            pending, self._pending = list(self._pending.values()), {}
        for req in pending:
            self._finish(req, err)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- deadlines -------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(_TICK):
            now = time.monotonic()
            with self._lock:
                late = [
                    (rid, r)
                    for rid, r in self._pending.items()
                    if now >= r.deadline
                ]
                for rid, _ in late:
                    del self._pending[rid]
                waiting = bool(self._pending)
            for _, req in late:
                self._finish(
                    req,
                    errors.RoundTimeoutError(
                        f"server {self.address} (push_pull of "
                        f"{req.header.name} round {req.header.round}): the "
                        "server did not answer within the deadline; it is "
                        "frozen, overloaded or gone (a round that misses a "
                        f"rank is answered after the {self.timeout:g} s "
                        "timeout, naming the rank)."
                    ),
                )
            if waiting and now - self._heard > 2 * self.timeout:
                self._fail_all(
                    errors.ServerUnavailableError(
                        f"server {self.address}: its data channel sent "
                        f"nothing for {now - self._heard:.0f} s"
                    )
                )
            if self._broken is not None:
                return

    def close(self) -> None:
        """Closes the connection; pending requests fail."""
        self._stop.set()
        self._fail_all(errors.JaxpsError("the data connection was closed"))
        self._reader.join(timeout=5)
        self._watchdog.join(timeout=5)
        self.sock.close()


class DataTransport(GrpcTransport):
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
            self.drop(conn, err)
            self.push_then_pull(chunk, credit, pushed)

    def _fall_back(self, chunk: Chunk, err: errors.JaxpsError) -> None:
        """Sends a chunk of a broken connection again, over gRPC (on a
        thread of its own: this runs on the connection's reader)."""
        self.drop(self.connection, err)
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
                chunk, SPENT, self._span("queue", chunk.queued, chunk)
            )
        except Exception as late:  # noqa: BLE001 - e.g. the channel closed
            chunk.handle.fail(
                errors.ServerUnavailableError(
                    f"{err}; sending it again over gRPC failed: {late!r}"
                )
            )

    def drop(self, conn: DataConnection | None, err) -> None:
        """Stops using `conn` (if it is still the connection) after `err`:
        chunks go over gRPC until the channel is opened again."""
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
