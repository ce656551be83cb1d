"""The data channel: bulk payloads on TCP (TLS on TLS servers), negotiated
over gRPC.

gRPC Python copies every payload several times and runs Python per message;
plain sockets read a chunk with one ``recv_into`` straight into a buffer and
send the sum with one ``sendmsg``, both outside the GIL. A server with TLS
speaks TLS here too, with the same certificates (and client certificates
when it asks for them), so encryption does not cost the fast path. The
frames are in `_wire` (``DATA_*``). The worker learns the port and a
one-time nonce from its Hello over gRPC; its first frame proves the nonce,
its rank and job (an HMAC under the job's token), and the connection is
bound to that rank.

What reaches the hello is bounded: at most `MAX_UNAUTHENTICATED`
connections (`MAX_UNAUTHENTICATED_PER_SOURCE` from one address) may be
waiting for theirs, each for `HELLO_TIMEOUT` seconds; more are closed at
once. The accept loop outlives a full file table (EMFILE, ENFILE) and
aborted connections: it logs, backs off and goes on.

Each connection has a reader thread (frames in, payloads into reused
buffers) and a writer thread (acknowledgements and sums out). The round
logic is the same as for gRPC pushes: the reader hands each request to the
server's event loop, where ``core.push`` and ``core.pull`` run, so exactly
once, windows, deadlines and error messages are those of the gRPC path.

A chunk costs as few thread handoffs as the GIL allows, since on small
partitions they, not the bytes, are the server's work: requests wait in
one inbox and the loop is woken once for all that came in before it
drains them (`DataChannel.submit`); a push from a slot whose round it
completes is answered by the sum alone, which has no bytes to carry (a
sum with bytes is acknowledged first: the worker's credit must not wait
for them on a slow link); and on plain TCP the loop sends an answer
itself, with a non-blocking ``sendmsg``, while the writer has nothing
queued, leaving the writer only what does not fit the socket's buffer
(`_Connection._reply`).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import hmac
import logging
import queue
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Coroutine
from typing import NamedTuple

from . import _wire

log = logging.getLogger("jaxps.server")

#: Seconds a nonce from a Hello stays valid.
NONCE_TTL = 120.0
#: Most nonces offered and not yet used (older ones are dropped).
MAX_NONCES = 4096
#: Seconds a new connection has to finish TLS and send its hello.
HELLO_TIMEOUT = 5.0
#: Most connections waiting for their hello, in all and from one address.
MAX_UNAUTHENTICATED = 128
MAX_UNAUTHENTICATED_PER_SOURCE = 32
#: Errors of ``accept`` that leave the listener usable (back off, go on).
_ACCEPT_TRANSIENT = {
    errno.EMFILE,
    errno.ENFILE,
    errno.ENOBUFS,
    errno.ENOMEM,
    errno.ECONNABORTED,
    errno.EPROTO,
    errno.EPERM,
}
#: Most payload buffers kept for reuse, in bytes, per server.
POOL_BYTES = 512 * 1024 * 1024


class Header:
    """The fields of a chunk's round, as `pb.Header` has them."""

    __slots__ = (
        "version",
        "job_id",
        "session",
        "rank",
        "key",
        "round",
        "dtype",
        "length",
        "name",
        "signature",
        "description",
        "check_key",
        "check_round",
        "check_call",
    )

    def __init__(self, job_id, session, rank, key, rnd, dtype, length, name):
        self.version = _wire.PROTOCOL_VERSION
        self.job_id = job_id
        self.session = session
        self.rank = rank
        self.key = key
        self.round = rnd
        self.dtype = dtype
        self.length = length
        self.name = name
        self.signature = 0  # a call check's (DATA_OP_CHECK), or carried
        self.description = ""
        self.check_key = 0  # a carried call check's (DATA_OP_PUSH_PULL_CHECKED)
        self.check_round = 0
        self.check_call = ""


class _BufferPool:
    """Payload buffers by size, reused once their round is summed."""

    def __init__(self, max_bytes: int):
        self._free: dict[int, list[bytearray]] = {}
        self._bytes = 0
        self._max = max_bytes
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._bytes -= nbytes
                return free.pop()
        return bytearray(nbytes)

    def give(self, buf: bytearray) -> None:
        with self._lock:
            if self._bytes + len(buf) <= self._max:
                self._free.setdefault(len(buf), []).append(buf)
                self._bytes += len(buf)


class DataChannel:
    """Listens for data connections and serves them with `core`.

    Args:
      core: the server's gRPC-free summation core (``check_header``,
        ``push``, ``pull``, ``incarnation``).
      host: interface to bind (the gRPC server's).
      loop: the event loop `core` runs on.
      token: the job's shared token (None: the mac uses an empty key).
      max_payload_bytes: largest accepted payload.
      port: the port to listen on (0: a free one).
      tls: the server side of TLS (`server_tls_context`), or None for
        plain TCP.

    Raises:
      OSError: naming the port if it cannot be bound.
    """

    def __init__(
        self,
        core,
        host: str,
        loop: asyncio.AbstractEventLoop,
        *,
        token: str | None,
        max_payload_bytes: int,
        port: int = 0,
        tls: ssl.SSLContext | None = None,
    ):
        self.core = core
        self.tls = tls
        self.loop = loop
        self.token = token
        self.max_payload_bytes = max_payload_bytes
        self.pool = _BufferPool(POOL_BYTES)
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        try:
            self._listener = socket.create_server(
                (host.strip("[]"), port), family=family, backlog=128
            )
        except OSError as err:
            raise OSError(
                err.errno,
                f"jaxps-server cannot bind its data channel to {host} port "
                f"{port}: {err.strerror} (--data-port)",
            ) from None
        self.port = self._listener.getsockname()[1]
        self._nonces: dict[bytes, tuple[int, str, str, float]] = {}
        self._lock = threading.Lock()
        #: connections waiting for their hello, by source address
        self._unauthenticated: dict[str, int] = {}
        self.refused = 0  # connections closed at once (over the caps)
        self._connections: set[_Connection] = set()
        self._inbox: collections.deque[Coroutine] = collections.deque()
        self._inbox_lock = threading.Lock()
        self._draining = False  # a `_drain` is scheduled on the loop
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_loop, name="jaxps-data-accept", daemon=True
        )
        self._thread.start()

    def submit(self, request: Coroutine) -> None:
        """Runs `request` on the event loop (from a reader thread).

        Requests wait in one inbox, and the loop is woken once for all
        those that came in before it drains them, instead of once each
        with a future to chain (`asyncio.run_coroutine_threadsafe`).
        """
        with self._inbox_lock:
            self._inbox.append(request)
            if self._draining:
                return
            self._draining = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._inbox_lock:
            requests = list(self._inbox)
            self._inbox.clear()
            self._draining = False
        for request in requests:
            task = self.loop.create_task(request)
            self._tasks.add(task)  # a task must be held while it runs
            task.add_done_callback(self._tasks.discard)

    def offer(self, rank: int, job_id: str, session: str) -> bytes:
        """A one-time nonce for a data connection of `rank` in `session`
        of `job_id`."""
        nonce = secrets.token_bytes(_wire.DATA_NONCE_BYTES)
        now = time.monotonic()
        with self._lock:
            for old, offer in list(self._nonces.items()):
                if offer[3] < now:
                    del self._nonces[old]
            while len(self._nonces) >= MAX_NONCES:  # drop the oldest
                del self._nonces[next(iter(self._nonces))]
            self._nonces[nonce] = (rank, job_id, session, now + NONCE_TTL)
        return nonce

    def _claim(self, nonce: bytes) -> tuple[int, str, str] | None:
        with self._lock:
            offer = self._nonces.pop(nonce, None)
        if offer is None or offer[3] < time.monotonic():
            return None
        return offer[:3]

    def _accept_loop(self) -> None:
        backoff = 0.0
        while True:
            try:
                sock, peer = self._listener.accept()
            except OSError as err:
                if self._closed or err.errno not in _ACCEPT_TRANSIENT:
                    return  # closed
                backoff = min(1.0, max(0.05, 2 * backoff))
                log.warning(
                    "data channel on port %d cannot accept (%s); trying "
                    "again in %.2f s",
                    self.port,
                    err.strerror,
                    backoff,
                )
                time.sleep(backoff)
                continue
            backoff = 0.0
            if not self._admit(peer[0]):
                sock.close()
                continue
            conn = _Connection(self, sock, peer)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._connections.add(conn)
            conn.start()

    def _admit(self, source: str) -> bool:
        """Counts a new connection from `source` as waiting for its hello,
        unless that would pass the caps (then it is refused)."""
        with self._lock:
            waiting = sum(self._unauthenticated.values())
            mine = self._unauthenticated.get(source, 0)
            if (
                waiting >= MAX_UNAUTHENTICATED
                or mine >= MAX_UNAUTHENTICATED_PER_SOURCE
            ):
                self.refused += 1
                refused = self.refused
            else:
                self._unauthenticated[source] = mine + 1
                return True
        if refused in (1, 10, 100) or refused % 1000 == 0:
            log.warning(
                "data channel on port %d refused %d connection(s) that "
                "had not said hello: %d wait already (%d from %s)",
                self.port,
                refused,
                waiting,
                mine,
                source,
            )
        return False

    def authenticated(self, source: str) -> None:
        """A connection from `source` is done with its hello (either way)."""
        with self._lock:
            left = self._unauthenticated.get(source, 1) - 1
            if left > 0:
                self._unauthenticated[source] = left
            else:
                self._unauthenticated.pop(source, None)

    def forget(self, conn: _Connection) -> None:
        with self._lock:
            self._connections.discard(conn)

    def close(self) -> None:
        """Stops listening and closes every connection."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn in connections:
            conn.close()


def server_tls_context(
    cert: str, key: str, client_ca: str | None = None
) -> ssl.SSLContext:
    """The data channel's TLS: the gRPC server's certificate and key, and
    client certificates signed by `client_ca` required if it is given."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca)
    # No session tickets: nothing but the writer thread ever writes.
    context.num_tickets = 0
    return context


def _send(sock: socket.socket, frame) -> None:
    """Sends a frame: its head, then its body unless it is None."""
    _wire.send_frame(sock, *(part for part in frame if part is not None))


class _Slot(NamedTuple):
    """A shared-memory slot a request names (as `pb.ShmSlot`)."""

    segment: int
    offset: int


class _Connection:
    """One worker's data connection: a reader and a writer thread."""

    def __init__(self, channel: DataChannel, sock: socket.socket, peer):
        self.channel = channel
        self.sock = sock
        self.peer = peer
        self.rank = -1
        self.job_id = ""
        self.session = ""
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        # frames queued for the writer and not all sent yet; a reply goes
        # out from its own thread only while this is 0 (the writer is idle)
        self._queued = 0
        self._queue_lock = threading.Lock()
        self._inline = False  # plain TCP: replies may skip the writer
        # requests handed to the loop and not answered yet; the writer
        # stops once the reader is done and this is 0
        self._busy = 0
        self._reading = True
        self._busy_lock = threading.Lock()
        self._reader = threading.Thread(
            target=self._read_loop, name="jaxps-data-read", daemon=True
        )
        self._writer = threading.Thread(
            target=self._write_loop, name="jaxps-data-write", daemon=True
        )

    def start(self) -> None:
        self._reader.start()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- reading -------------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            if not self._handshake():
                return
            self._writer.start()
            head = memoryview(bytearray(_wire.DATA_REQUEST.size))
            while True:
                _wire.recv_exact(self.sock, head)
                if not self._request(head):
                    return
        except (OSError, ConnectionError):
            pass  # the worker went away; its rounds time out as usual
        except Exception:  # noqa: BLE001 - never kill the server
            log.exception("data connection from %s failed", self.peer)
        finally:
            with self._busy_lock:
                self._reading = False
                idle = self._busy == 0
            if idle:
                self._out.put(None)
            self.channel.forget(self)
            if not self._writer.is_alive():
                self.sock.close()

    def _handshake(self) -> bool:
        try:
            return self._hello()
        finally:
            self.channel.authenticated(self.peer[0])

    def _hello(self) -> bool:
        """TLS (on TLS servers), then the worker's hello, within
        `HELLO_TIMEOUT`; False if refused (the worker was told why)."""
        deadline = time.monotonic() + HELLO_TIMEOUT
        self.sock.settimeout(HELLO_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, _wire.DATA_SNDBUF
        )
        if self.channel.tls is not None:
            self.sock = self.channel.tls.wrap_socket(
                self.sock, server_side=True
            )
            self.sock.settimeout(max(0.1, deadline - time.monotonic()))
        raw = memoryview(bytearray(_wire.DATA_HELLO.size))
        view = raw
        while len(view):  # by the deadline, however slowly it trickles
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no hello within {HELLO_TIMEOUT:g} s")
            self.sock.settimeout(left)
            n = self.sock.recv_into(view, len(view))
            if n == 0:
                raise ConnectionError("the peer closed before its hello")
            view = view[n:]
        magic, version, rank, nonce, mac = _wire.DATA_HELLO.unpack(raw)
        error = None
        if magic != _wire.DATA_MAGIC:
            error = "not a jaxps data connection (bad magic)"
        elif version != _wire.PROTOCOL_VERSION:
            error = (
                f"protocol version mismatch: worker speaks version "
                f"{version}, server speaks {_wire.PROTOCOL_VERSION}"
            )
        else:
            offer = self.channel._claim(nonce)
            if offer is None or offer[0] != rank:
                error = (
                    f"data connection of rank {rank} names no valid nonce "
                    "(say Hello over gRPC first; nonces are used once)"
                )
            else:
                expected = _wire.data_mac(self.channel.token, nonce, *offer[:2])
                if not hmac.compare_digest(mac, expected):
                    error = (
                        "missing or wrong jaxps token on the data channel: "
                        "set the same JAXPS_TOKEN on workers and --token "
                        "on servers."
                    )
                else:
                    self.rank, self.job_id, self.session = offer
        self.sock.settimeout(None)
        if error is not None:
            code = (
                "UNAUTHENTICATED" if "token" in error else "FAILED_PRECONDITION"
            )
            self._send_now(_error_frame(0, code, error))
            return False
        body = self.channel.core.incarnation.encode()
        self._send_now(
            (_wire.DATA_REPLY.pack(_wire.DATA_OK, 0, 0, 0, len(body)), body)
        )
        self._inline = not isinstance(self.sock, ssl.SSLSocket)
        return True

    def _send_now(self, frame) -> None:
        try:
            _send(self.sock, frame)
        except OSError:
            pass

    def _request(self, head: memoryview) -> bool:
        """Reads one request after its header; False ends the connection."""
        (
            op,
            dtype,
            name_len,
            rank,
            key,
            rnd,
            length,
            checksum,
            rid,
            timeout,
        ) = _wire.DATA_REQUEST.unpack(head)
        in_slot = bool(op & _wire.DATA_OP_IN_SLOT)
        op &= ~_wire.DATA_OP_IN_SLOT
        known = op in _wire.DATA_OPS and not (
            in_slot and op == _wire.DATA_OP_CHECK
        )
        if not known or rank != self.rank:
            what = (
                f"unknown op {op}{' in a slot' if in_slot else ''}"
                if not known
                else f"rank {rank} on the connection of rank {self.rank}"
            )
            self._reply(
                _error_frame(rid, "INVALID_ARGUMENT", f"data frame: {what}")
            )
            return False  # the stream cannot be trusted past this frame
        try:
            itemsize = _wire.code_dtype(dtype).itemsize
        except KeyError:
            itemsize = 1  # the store names the bad dtype; keep the stream
        nbytes = length * itemsize
        if nbytes > self.channel.max_payload_bytes:
            self._reply(
                _error_frame(
                    rid,
                    "RESOURCE_EXHAUSTED",
                    f"payload of key {key} round {rnd} is {nbytes} bytes; "
                    f"this server takes at most "
                    f"{self.channel.max_payload_bytes} (--max-message-bytes)",
                )
            )
            return False
        name = bytearray(name_len)
        _wire.recv_exact(self.sock, memoryview(name))
        slot = None
        buf = None
        if in_slot:  # the payload is in the worker's shared memory
            ref = bytearray(_wire.DATA_SLOT.size)
            _wire.recv_exact(self.sock, memoryview(ref))
            slot = _Slot(*_wire.DATA_SLOT.unpack(ref))
        else:
            buf = self.channel.pool.take(nbytes)
            _wire.recv_exact(self.sock, memoryview(buf))
        h = Header(self.job_id, self.session, rank, key, rnd, dtype, length, "")
        if op == _wire.DATA_OP_CHECK:
            h.signature, h.name, h.description = _wire.decode_check_name(
                bytes(name)
            )
        elif op == _wire.DATA_OP_PUSH_PULL_CHECKED:
            try:
                _wire.decode_carrier_name(bytes(name), h)
            except _wire.Rejected as err:
                if slot is None:
                    self.channel.pool.give(buf)
                self._reply(_error_frame(rid, err.code, err.message))
                return False
        else:
            h.name = name.decode(errors="replace")
        with self._busy_lock:
            self._busy += 1
        self.channel.submit(self._serve(h, rid, buf, checksum, timeout, slot))
        return True

    async def _serve(
        self, h, rid: int, buf, checksum: int, timeout: float, slot=None
    ):
        """Pushes and pulls one chunk on the event loop; its last frame is
        queued before the writer may stop."""
        try:
            await self._push_pull(h, rid, buf, checksum, timeout, slot)
        finally:
            with self._busy_lock:
                self._busy -= 1
                last = self._busy == 0 and not self._reading
            if last:
                self._out.put(None)

    async def _push_pull(self, h, rid, buf, checksum, timeout, slot) -> None:
        """`buf` holds the payload, or with a `slot` (then `buf` is None)
        the worker's shared memory does, and the sum goes there."""
        core = self.channel.core
        try:
            payload = None if slot is not None else memoryview(buf)
            target = await core.push(h, payload, checksum, slot)
            deadline = time.monotonic() + min(max(0.0, timeout), 3600.0)
            ack = functools.partial(self._reply, (_ack(rid), None))
            if slot is None:
                # The credit comes back before the sum's bytes, which a
                # slow link takes a while to carry.
                ack()
            # A sum in a slot has no bytes: ready at once, it is the
            # acknowledgement itself (one frame, not two).
            total, contributors = await core.pull_counted(
                h,
                deadline=deadline,
                raw=True,
                into=None if slot is None else target,
                on_wait=None if slot is None else ack,
            )
        except _wire.Rejected as err:
            self._reply(_error_frame(rid, err.code, err.message))
            return
        except Exception as err:  # noqa: BLE001 - reported to the worker
            log.exception("data request failed")
            self._reply(_error_frame(rid, "INTERNAL", repr(err)))
            return
        if slot is not None:  # the sum is in the slot
            self._reply(
                (
                    _wire.DATA_REPLY.pack(
                        _wire.DATA_SUM, 0, contributors, rid, 0
                    ),
                    None,
                )
            )
            return
        # The round is summed: the store holds no view of `buf` any more.
        self.channel.pool.give(buf)
        self._reply(
            (
                _wire.DATA_REPLY.pack(
                    _wire.DATA_SUM, 0, contributors, rid, total.nbytes
                ),
                total,
            )
        )

    # -- writing -------------------------------------------------------------

    def _reply(self, frame) -> None:
        """Sends `frame` (head, body or None) after those before it.

        On plain TCP, when the writer has nothing queued, the calling
        thread (the event loop) sends the frame with one non-blocking
        ``sendmsg``: as much as the socket's buffer takes (at most
        `_wire.DATA_SNDBUF` or so), and the writer sends the rest. That
        saves the writer thread's wake-up on every chunk whose answer fits
        the buffer. Frames are queued for the writer while it has some,
        and always on TLS.
        """
        with self._queue_lock:  # no frame is queued while one goes inline
            if self._inline and self._queued == 0:
                try:
                    frame = _wire.send_now(self.sock, *frame)
                except OSError:
                    self.close()  # the reader sees it and ends
                    return
                if not frame:
                    return
            # the writer sends it (the rest of it, if the socket was full)
            self._queued += 1
            self._out.put(frame)

    def _write_loop(self) -> None:
        try:
            while True:
                frame = self._out.get()
                if frame is None:
                    return
                _send(self.sock, frame)
                with self._queue_lock:
                    self._queued -= 1
        except OSError:
            self.close()  # the reader sees it and ends
        except Exception:  # noqa: BLE001 - never leave a worker waiting
            log.exception("data connection to %s failed", self.peer)
            self.close()
        finally:
            if not self._reader.is_alive():
                self.sock.close()


def _ack(rid: int) -> bytes:
    return _wire.DATA_REPLY.pack(_wire.DATA_ACK, 0, 0, rid, 0)


def _error_frame(rid: int, code: str, message: str):
    body = message.encode()[: _wire.DATA_MAX_TEXT]
    status = (
        _wire.STATUS_CODES.index(code)
        if code in _wire.STATUS_CODES
        else _wire.STATUS_CODES.index("UNKNOWN")
    )
    return (
        _wire.DATA_REPLY.pack(_wire.DATA_ERROR, status, 0, rid, len(body)),
        body,
    )
