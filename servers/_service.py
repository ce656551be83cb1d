"""The gRPC summation service: a thin servicer over `_summation.Summation`.

Each RPC decodes its request, calls the core and encodes the answer; a
`_wire.Rejected` becomes the gRPC status of the same name, with the
server's incarnation in the trailing metadata.
"""

from __future__ import annotations

import math
import os
import time

import grpc

from . import _codec, _wire
from . import jaxps_pb2 as pb
from ._summation import Summation

_CODES = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "ABORTED": grpc.StatusCode.ABORTED,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "DEADLINE_EXCEEDED": grpc.StatusCode.DEADLINE_EXCEEDED,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def _decode(message_type, data: bytes):
    try:
        return message_type.FromString(data)
    except Exception as err:  # protobuf's DecodeError
        raise _wire.Rejected(
            "INVALID_ARGUMENT",
            f"malformed {message_type.__name__}: {err}",
        ) from None


def _decode_push(request: bytes):
    try:
        return _codec.decode_push(request)
    except _codec.DecodeError as err:
        raise _wire.Rejected(
            "INVALID_ARGUMENT", f"malformed PushRequest: {err}"
        ) from None


def _deadline(context) -> float:
    """The call's deadline as a `time.monotonic()` value (inf: none)."""
    remaining = context.time_remaining()
    return math.inf if remaining is None else time.monotonic() + remaining


class SummationServicer:
    """Provides methods that implement functionality of the summation server.

    Args:
      summation: the gRPC-free core the RPCs call.
    """

    def __init__(self, summation: Summation, data=None, shm=None):
        self.summation = summation
        #: the data channel (`_data.DataChannel`) offered in Hello, or None
        self.data = data
        #: the Unix socket that takes shared-memory segments
        #: (`_fdpass.FdInbox`) offered in Hello, or None
        self.shm = shm

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's method handlers; requests arrive undecoded."""
        methods = {
            "Hello": grpc.unary_unary_rpc_method_handler(
                self.Hello,
                response_serializer=pb.HelloReply.SerializeToString,
            ),
            "Push": grpc.unary_unary_rpc_method_handler(
                self.Push,
                response_serializer=pb.PushReply.SerializeToString,
            ),
            # Pull replies are encoded once per round by the store.
            "Pull": grpc.unary_unary_rpc_method_handler(self.Pull),
            "PushPull": grpc.unary_unary_rpc_method_handler(self.PushPull),
            "Attach": grpc.unary_unary_rpc_method_handler(
                self.Attach,
                response_serializer=pb.AttachReply.SerializeToString,
            ),
            "Detach": grpc.unary_unary_rpc_method_handler(
                self.Detach,
                response_serializer=pb.DetachReply.SerializeToString,
            ),
            "Bye": grpc.unary_unary_rpc_method_handler(
                self.Bye,
                response_serializer=pb.ByeReply.SerializeToString,
            ),
            "Join": grpc.unary_unary_rpc_method_handler(
                self.Join,
                response_serializer=pb.JoinReply.SerializeToString,
            ),
            "Rendezvous": grpc.unary_unary_rpc_method_handler(
                self.Rendezvous,
                response_serializer=pb.RendezvousReply.SerializeToString,
            ),
        }
        return grpc.method_handlers_generic_handler(_wire.SERVICE_NAME, methods)

    async def _abort(self, context, err: _wire.Rejected):
        code = _CODES.get(err.code) or getattr(grpc.StatusCode, err.code)
        # Lets a worker tell "rejected" from "rejected by a restarted server".
        context.set_trailing_metadata(
            ((_wire.INCARNATION_KEY, self.summation.incarnation),)
        )
        await context.abort(code, err.message)

    # -- RPCs --------------------------------------------------------------

    async def Hello(self, request: bytes, context):
        core = self.summation
        try:
            request = _decode(pb.HelloRequest, request)
            session = core.hello(
                request,
                request.num_workers,
                init_id=request.init_id,
                timeout=request.timeout,
                generation=request.generation,
                host=_host_of(context.peer()),
            )
        except _wire.Rejected as err:
            await self._abort(context, err)
        reply = pb.HelloReply(
            version=_wire.PROTOCOL_VERSION,
            incarnation=core.incarnation,
            num_workers=core.num_workers,
            job_id=request.job_id,
            async_mode=core.async_mode,
            session=session.id,
        )
        if self.shm is not None:
            reply.shm_socket = self.shm.name
        if self.data is not None:
            reply.data_port = self.data.port
            reply.data_nonce = self.data.offer(
                request.rank, request.job_id, session.id
            )
        return reply

    async def Push(self, request: bytes, context):
        try:
            await self.summation.push(*_decode_push(request))
        except _wire.Rejected as err:
            await self._abort(context, err)
        return pb.PushReply(incarnation=self.summation.incarnation)

    async def Pull(self, request: bytes, context) -> bytes:
        core = self.summation
        try:
            request = _decode(pb.PullRequest, request)
            slot = request.slot if request.HasField("slot") else None
            result = await core.pull(
                request.header, deadline=_deadline(context), slot=slot
            )
        except _wire.Rejected as err:
            await self._abort(context, err)
        return result  # an encoded PullReply

    async def PushPull(self, request: bytes, context) -> bytes:
        """Push from a shared-memory slot, then Pull into it, in one call."""
        core = self.summation
        try:
            h, payload, checksum, slot = _decode_push(request)
            if slot is None:
                raise _wire.Rejected(
                    "INVALID_ARGUMENT",
                    f"PushPull of key {h.key} round {h.round} by rank "
                    f"{h.rank} names no shared-memory slot; use Push and "
                    "Pull for payloads in messages.",
                )
            target = await core.push(h, payload, checksum, slot)
            result = await core.pull(
                h, deadline=_deadline(context), into=target
            )
        except _wire.Rejected as err:
            await self._abort(context, err)
        return result  # the reply that the sum is in the slot

    async def Attach(self, request: bytes, context):
        core = self.summation
        try:
            request = _decode(pb.AttachRequest, request)
            h = request.header
            core.check_header(h)
            fd = None if self.shm is None else self.shm.claim(request.cookie)
            if fd is None:
                raise _wire.Rejected(
                    "FAILED_PRECONDITION",
                    f"Attach of rank {h.rank} names no segment this server "
                    "received on its Unix socket (shm_socket in HelloReply; "
                    "the worker is not on this host, or waited too long).",
                )
            try:
                segment = core.attach(h, fd, request.size)
            finally:
                os.close(fd)
        except _wire.Rejected as err:
            await self._abort(context, err)
        return pb.AttachReply(incarnation=core.incarnation, segment=segment)

    async def Detach(self, request: bytes, context):
        try:
            request = _decode(pb.DetachRequest, request)
            self.summation.detach(request.header, request.segments)
        except _wire.Rejected as err:
            await self._abort(context, err)
        return pb.DetachReply(incarnation=self.summation.incarnation)

    async def Bye(self, request: bytes, context):
        try:
            self.summation.bye(_decode(pb.ByeRequest, request).header)
        except _wire.Rejected as err:
            await self._abort(context, err)
        return pb.ByeReply(incarnation=self.summation.incarnation)

    async def Join(self, request: bytes, context):
        """Rank joins (`jaxps.join`); answered once every rank has."""
        core = self.summation
        try:
            request = _decode(pb.JoinRequest, request)
            timeout = request.timeout
            if not 0 <= timeout < math.inf:  # also NaN
                raise _wire.Rejected(
                    "INVALID_ARGUMENT",
                    f"join timeout must be finite and >= 0, got {timeout}.",
                )
            deadline = min(_deadline(context), time.monotonic() + timeout)
            last = await core.join(request.header, deadline=deadline)
        except _wire.Rejected as err:
            await self._abort(context, err)
        return pb.JoinReply(incarnation=core.incarnation, last_rank=last)

    async def Rendezvous(self, request: bytes, context):
        """Elastic membership (`jaxps.elastic`): answered once the next
        generation closes, or at once for a probe."""
        core = self.summation
        try:
            request = _decode(pb.RendezvousRequest, request)
            generation, members, waiting = await core.rendezvous(
                request, deadline=_deadline(context)
            )
        except _wire.Rejected as err:
            await self._abort(context, err)
        return pb.RendezvousReply(
            incarnation=core.incarnation,
            generation=generation,
            members=members,
            waiting=waiting,
        )


def _host_of(peer: str) -> str:
    """The address of a gRPC peer (``ipv4:10.0.0.2:5123`` -> ``10.0.0.2``)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0]
    return peer
