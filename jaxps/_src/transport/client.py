"""gRPC client of one summation server, with deadlines and safe retries."""

from __future__ import annotations

import random
import secrets
import socket
import ssl
import time

import grpc

from jaxps._src import errors
from jaxps.servers import _codec, _wire
from jaxps.servers import jaxps_pb2 as pb

#: Longest pause between two attempts of a call that failed with UNAVAILABLE.
#: Such calls are retried until their deadline: a push is deduplicated by the
#: server, so retrying it is safe.
MAX_BACKOFF = 0.5
#: How long after its first UNAVAILABLE a call is retried (at most until its
#: deadline, and at most half the client's timeout): long enough for a server
#: restart, short enough to report a dead server soon. Half: while this
#: rank retries, the other servers time out (after the timeout) the rounds
#: it has not sent yet, and the other ranks would hear "waiting for rank r"
#: rather than the dead server's name. A pull that waits for its round has
#: a longer deadline than the timeout, but a dead server is still reported
#: within half of it.
RETRY_WINDOW = 10.0
#: Longest wait for the answer to a Bye (the server may be gone).
BYE_TIMEOUT = 1.0
#: Seconds a Join call may take beyond its own timeout (the server answers
#: by then, naming the ranks that have not joined).
JOIN_MARGIN = 5.0

_REJECTED = {getattr(grpc.StatusCode, n) for n in _wire.REJECTED_STATUSES}


def channel_credentials(config) -> grpc.ChannelCredentials | None:
    """The TLS credentials of a `Config` from its PEM files (``tls_ca``,
    and ``tls_cert``/``tls_key`` for client auth); None without TLS."""
    if not config.tls_ca:
        return None
    ca, cert, key = config.tls_ca, config.tls_cert, config.tls_key

    def read(path, what):
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as err:
            raise errors.ConfigError(
                f"cannot read {what} {path!r}: {err}"
            ) from None

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca, "tls_ca"),
        private_key=read(key, "tls_key") if key else None,
        certificate_chain=read(cert, "tls_cert") if cert else None,
    )


def tls_context(config) -> ssl.SSLContext | None:
    """The data channel's TLS, from the same PEM files as
    `channel_credentials`; None without TLS."""
    if not config.tls_ca:
        return None
    try:
        context = ssl.create_default_context(cafile=config.tls_ca)
        if config.tls_cert:
            context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as err:
        raise errors.ConfigError(
            f"cannot load the TLS files tls_ca={config.tls_ca!r}, "
            f"tls_cert={config.tls_cert!r}, tls_key={config.tls_key!r}: {err}"
        ) from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class ServerClient:
    """Talks to one server: hello, push and pull, each with a deadline."""

    def __init__(
        self,
        address: str,
        *,
        max_message_bytes: int,
        timeout: float,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ):
        self.address = address
        self.timeout = timeout
        options = _wire.channel_options(max_message_bytes) + [
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.enable_retries", 0),
            # one connection per client, so several clients of a server
            # spread over several TCP connections
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(
                address, credentials, options=options
            )
        self._metadata = ((_wire.TOKEN_KEY, token),) if token else None
        method = f"/{_wire.SERVICE_NAME}/"
        self._hello = self._channel.unary_unary(
            method + "Hello",
            request_serializer=pb.HelloRequest.SerializeToString,
            response_deserializer=pb.HelloReply.FromString,
        )
        # Push requests and pull replies carry the payload: they are encoded
        # and decoded by `_codec` to copy it once.
        self._push = self._channel.unary_unary(
            method + "Push", response_deserializer=pb.PushReply.FromString
        )
        self._pull = self._channel.unary_unary(
            method + "Pull",
            request_serializer=pb.PullRequest.SerializeToString,
        )
        self._push_pull = self._channel.unary_unary(method + "PushPull")
        self._attach = self._channel.unary_unary(
            method + "Attach",
            request_serializer=pb.AttachRequest.SerializeToString,
            response_deserializer=pb.AttachReply.FromString,
        )
        self._detach = self._channel.unary_unary(
            method + "Detach",
            request_serializer=pb.DetachRequest.SerializeToString,
            response_deserializer=pb.DetachReply.FromString,
        )
        self._bye = self._channel.unary_unary(
            method + "Bye",
            request_serializer=pb.ByeRequest.SerializeToString,
            response_deserializer=pb.ByeReply.FromString,
        )
        self._join = self._channel.unary_unary(
            method + "Join",
            request_serializer=pb.JoinRequest.SerializeToString,
            response_deserializer=pb.JoinReply.FromString,
        )
        self._rendezvous = self._channel.unary_unary(
            method + "Rendezvous",
            request_serializer=pb.RendezvousRequest.SerializeToString,
            response_deserializer=pb.RendezvousReply.FromString,
        )
        self._header: pb.Header | None = None
        #: the job incarnation the server put this worker in (see Hello)
        self.session = ""
        self._failed = False  # a call failed: close says no Bye
        self.shm_socket = ""
        self.incarnation: str | None = None
        self.async_mode = False
        self.data_port = 0
        self.data_nonce = b""
        #: seconds a call retries UNAVAILABLE (see RETRY_WINDOW); failover
        #: shortens it, and waits for a restarted server itself
        self.retry_window = RETRY_WINDOW

    def close(self) -> None:
        """Says Bye (the server frees the job's state once every rank has)
        and closes the channel."""
        if self._header is not None and not self._failed:
            try:
                self._bye(
                    pb.ByeRequest(header=self._header),
                    timeout=min(BYE_TIMEOUT, self.timeout),
                    metadata=self._metadata,
                )
            except grpc.RpcError:
                pass  # the server is gone, or freed the session already
            self._header = None
        self._channel.close()

    def hello(
        self,
        *,
        job_id: str,
        rank: int,
        num_workers: int,
        init_id: str | None = None,
        generation: int = 0,
        wait: float | None = None,
    ) -> str:
        """Waits up to `wait` (default: the timeout) for the server; checks
        job and size, and joins a job incarnation; returns the server's
        incarnation.

        `init_id` names the worker's init (the same for all its clients),
        so that the server tells its other channels from a new init of the
        rank. A second hello (a reconnect) keeps the session.
        """
        if init_id is None:
            init_id = secrets.token_hex(8)
        self._hello_args = dict(
            job_id=job_id,
            rank=rank,
            num_workers=num_workers,
            init_id=init_id,
            generation=generation,
        )
        request = pb.HelloRequest(
            version=_wire.PROTOCOL_VERSION,
            job_id=job_id,
            rank=rank,
            num_workers=num_workers,
            session=self.session,
            init_id=init_id,
            timeout=self.timeout,
            generation=generation,
        )
        wait = self.timeout if wait is None else wait
        try:
            reply = self._hello(
                request,
                timeout=wait,
                wait_for_ready=True,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            if err.code() in (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAVAILABLE,
            ):
                raise errors.ServerUnavailableError(
                    f"server {self.address} did not answer within "
                    f"{wait:.3g} s (rank {rank}, job {job_id!r}): is "
                    "jaxps-server running there?"
                ) from None
            raise self.translate(err, "hello") from None
        self.incarnation = reply.incarnation
        self.async_mode = reply.async_mode
        #: the data channel's port (0: not offered) and one-time nonce
        self.data_port = reply.data_port
        self.data_nonce = reply.data_nonce
        self.session = reply.session
        #: the server's Unix socket for shared-memory segments ("": none)
        self.shm_socket = reply.shm_socket
        self._header = pb.Header(
            version=_wire.PROTOCOL_VERSION,
            job_id=job_id,
            rank=rank,
            session=reply.session,
        )
        return reply.incarnation

    def hello_again(self) -> None:
        """Repeats the last hello in the same session (a reconnect): the
        server offers a new data-channel nonce."""
        self.hello(**self._hello_args)

    def attach(self, fd: int, size: int) -> int:
        """Has the server map a sealed memfd of `size` bytes; returns the
        segment's id. Raises OSError if the server's Unix socket cannot be
        reached (it is on another host, or in another network namespace).
        """
        if not self.shm_socket:
            raise OSError(f"server {self.address} offers no shared memory")
        cookie = secrets.token_bytes(_wire.SHM_COOKIE_BYTES)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(min(self.timeout, 5.0))
            sock.connect("\0" + self.shm_socket)
            socket.send_fds(sock, [cookie], [fd])
            if sock.recv(1) != b"\1":
                raise OSError(f"server {self.address} refused the segment")
        request = pb.AttachRequest(
            header=self._header, size=size, cookie=cookie
        )
        deadline = time.monotonic() + self.timeout
        reply = self._call(self._attach, request, deadline, None, "attach")
        self._check_incarnation(reply.incarnation, self._header)
        return reply.segment

    def detach(self, segments, timeout: float = 0.25) -> None:
        """Has the server unmap segments; errors are ignored. Best effort
        within `timeout` (on 127.0.0.1 it takes about a millisecond): a
        frozen server must not hold up a worker's shutdown, and a server
        frees a job incarnation's segments with it."""
        request = pb.DetachRequest(header=self._header, segments=segments)
        try:
            self._detach(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError:
            pass  # the server is gone: its mappings went with it

    def push(
        self,
        header: pb.Header,
        payload,
        checksum: int,
        deadline: float,
        slot: pb.ShmSlot | None = None,
    ) -> None:
        """Pushes one chunk (an array, or a filled `slot`); retries
        UNAVAILABLE until `deadline`."""
        header.session = self.session
        request = _codec.encode_push(header, payload, checksum, slot)
        reply = self._call(self._push, request, deadline, header, "push")
        self._check_incarnation(reply.incarnation, header)

    def abort(self, header: pb.Header, reason: str, timeout: float) -> None:
        """Tells the server this rank gives up `header`'s round (its call
        failed): the round fails for every rank with `reason`. Best effort,
        one attempt within `timeout`: the other ranks time out anyway."""
        h = pb.Header()
        h.CopyFrom(header)
        h.session = self.session
        h.abort = reason[:1000] or "unknown error"
        request = _codec.encode_push(h, b"", 0)
        try:
            self._push(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError:
            pass

    def push_pull_future(
        self, header: pb.Header, checksum: int, deadline: float, slot
    ):
        """Starts a PushPull of a filled shared-memory `slot`; returns a
        grpc future of the encoded PullReply (the sum is then in `slot`)."""
        header.session = self.session
        request = _codec.encode_push(header, None, checksum, slot)
        return self._push_pull.future(
            request,
            timeout=max(0.01, deadline - time.monotonic()),
            metadata=self._metadata,
        )

    def push_pull(
        self, header: pb.Header, checksum: int, deadline: float, slot
    ) -> int:
        """PushPull of a filled `slot`, blocking; retries UNAVAILABLE.
        Returns how many ranks the sum is over (0: not said)."""
        header.session = self.session
        request = _codec.encode_push(header, None, checksum, slot)
        reply = self._call(
            self._push_pull, request, deadline, header, "push_pull"
        )
        return self.decode_pull_counted(reply, header, slot)[1]

    def pull_future(self, header: pb.Header, deadline: float, slot=None):
        """Starts a pull; returns a grpc future of the encoded PullReply."""
        header.session = self.session
        request = pb.PullRequest(header=header, slot=slot)
        return self._pull.future(
            request,
            timeout=max(0.01, deadline - time.monotonic()),
            metadata=self._metadata,
        )

    def pull(
        self, header: pb.Header, deadline: float, slot=None
    ) -> memoryview | None:
        """Pulls one chunk's sum, blocking; retries UNAVAILABLE."""
        return self.pull_counted(header, deadline, slot)[0]

    def pull_counted(
        self, header: pb.Header, deadline: float, slot=None
    ) -> tuple[memoryview | None, int]:
        """`pull`, and how many ranks the sum is over (0: not said)."""
        header.session = self.session
        request = pb.PullRequest(header=header, slot=slot)
        reply = self._call(self._pull, request, deadline, header, "pull")
        return self.decode_pull_counted(reply, header, slot)

    def decode_pull(
        self, reply: bytes, header: pb.Header, slot=None
    ) -> memoryview | None:
        """Checks an encoded PullReply; returns its payload, or None if the
        sum is in `slot`."""
        return self.decode_pull_counted(reply, header, slot)[0]

    def decode_pull_counted(
        self, reply: bytes, header: pb.Header, slot=None
    ) -> tuple[memoryview | None, int]:
        """`decode_pull`, and how many ranks the sum is over (0: not
        said)."""
        try:
            incarnation, payload, in_slot, contributors = (
                _codec.decode_pull_reply(reply)
            )
        except _codec.DecodeError as err:
            raise errors.JaxpsError(
                f"server {self.address} sent a malformed reply to the pull "
                f"of {header.name} round {header.round}: {err}"
            ) from None
        self._check_incarnation(incarnation, header)
        if in_slot != (slot is not None):
            raise errors.JaxpsError(
                f"server {self.address} answered the pull of {header.name} "
                f"round {header.round} "
                + (
                    "in shared memory, which was not asked for."
                    if in_slot
                    else "without the sum in shared memory."
                )
            )
        return (None if in_slot else payload), contributors

    def join(self, epoch: int, timeout: float) -> int:
        """Joins (`jaxps.join`) the rank's `epoch`-th join epoch; returns,
        once every rank has joined, the rank that joined last. The server
        names the ranks that have not joined after `timeout` seconds."""
        header = pb.Header()
        header.CopyFrom(self._header)
        header.round = epoch
        header.name = "jaxps.join"
        request = pb.JoinRequest(header=header, timeout=timeout)
        deadline = time.monotonic() + timeout + JOIN_MARGIN
        reply = self._call(self._join, request, deadline, header, "join")
        self._check_incarnation(reply.incarnation, header)
        return reply.last_rank

    def rendezvous(
        self, request: pb.RendezvousRequest, timeout: float
    ) -> pb.RendezvousReply:
        """Elastic membership (see `jaxps.elastic`): waits up to `timeout`
        for the next generation (a probe answers at once)."""
        request.version = _wire.PROTOCOL_VERSION
        request.timeout = timeout
        deadline = time.monotonic() + timeout + JOIN_MARGIN
        what = "probe" if request.probe else "rendezvous"
        header = pb.Header(job_id=request.job_id, name=f"elastic {what}")
        return self._call(self._rendezvous, request, deadline, header, what)

    def _call(self, method, request, deadline, header, what):
        """Calls `method`, retrying UNAVAILABLE until `deadline`."""
        attempt, give_up = 0, deadline
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            try:
                return method(
                    request,
                    timeout=max(0.01, remaining),
                    metadata=self._metadata,
                )
            except grpc.RpcError as err:
                if attempt == 1:
                    window = min(self.retry_window, self.timeout / 2)
                    give_up = min(deadline, time.monotonic() + window)
                pause = min(MAX_BACKOFF, 0.02 * 2**attempt)
                pause *= random.uniform(0.5, 1.0)
                retry = (
                    err.code() == grpc.StatusCode.UNAVAILABLE
                    and give_up - time.monotonic() > pause
                )
                if not retry:
                    raise self.translate(err, what, header) from None
            time.sleep(pause)

    def _check_incarnation(self, incarnation: str, header) -> None:
        if self.incarnation is not None and incarnation != self.incarnation:
            raise errors.ServerRestartedError(
                f"server {self.address} restarted during the job (while "
                f"serving {header.name or header.key} round {header.round}) "
                "and lost its rounds; restart the job."
            )

    def _restarted(self, err: grpc.RpcError) -> errors.JaxpsError | None:
        try:
            trailing = err.trailing_metadata() or ()
        except Exception:  # noqa: BLE001 - not every RpcError has metadata
            return None
        for key, value in trailing:
            if key == _wire.INCARNATION_KEY and self.incarnation not in (
                None,
                value,
            ):
                return errors.ServerRestartedError(
                    f"server {self.address} restarted during the job and lost "
                    f"its rounds (it now says: {err.details()}); restart the "
                    "job."
                )
        return None

    def translate(
        self, err: grpc.RpcError, what: str, header: pb.Header | None = None
    ) -> errors.JaxpsError:
        """Turns a grpc error into the matching jaxps error."""
        self._failed = True
        code, details = err.code(), err.details() or ""
        restarted = self._restarted(err)
        if restarted is not None:
            return restarted
        where = f"server {self.address}"
        if header is not None:
            label = header.name or f"key {header.key}"
            where += f" ({what} of {label} round {header.round})"
        else:
            where += f" ({what})"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            if details and "Deadline Exceeded" not in details:
                return errors.RoundTimeoutError(f"{where}: {details}")
            return errors.RoundTimeoutError(
                f"{where}: the server did not answer within the deadline; it "
                "is frozen, overloaded or gone (a round that misses a rank "
                f"is answered after the {self.timeout:g} s timeout, naming "
                "the rank)."
            )
        if code in _REJECTED:
            if _wire.MISMATCH_PREFIX in details:
                return errors.MismatchError(f"{where}: {details}")
            return errors.RequestRejectedError(
                f"{where} rejected the request ({code.name}): {details}"
            )
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return errors.ServerUnavailableError(
                f"{where} is unavailable ({code.name}): {details}"
            )
        return errors.JaxpsError(f"{where} failed ({code.name}): {details}")
