"""The gRPC summation service: a thin servicer over `_store.Store`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import secrets
import time

import grpc

from . import _async_store, _codec, _shm, _store, _wire
from . import jaxps_pb2 as pb

log = logging.getLogger("jaxps.server")


_CODES = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "ABORTED": grpc.StatusCode.ABORTED,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "DEADLINE_EXCEEDED": grpc.StatusCode.DEADLINE_EXCEEDED,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
}


#: Pushes of at most this many bytes are always summed on the event loop.
INLINE_SUM_BYTES = 256 * 1024


def _chunk(h: pb.Header) -> dict:
    """The header fields that name a chunk's round, as the store's
    keyword arguments."""
    return dict(
        key=h.key,
        round=h.round,
        rank=h.rank,
        dtype_code=h.dtype,
        length=h.length,
    )


def _decode(message_type, data: bytes):
    try:
        return message_type.FromString(data)
    except Exception as err:  # protobuf's DecodeError
        raise _store.StoreError(
            "INVALID_ARGUMENT",
            f"malformed {message_type.__name__}: {err}",
        ) from None


class SummationServicer:
    """Provides methods that implement functionality of the summation server.

    Args:
      num_workers: number of worker ranks in the job.
      job_id: the job this server serves; ``None`` adopts the job id of the
        first worker that says hello.
      round_timeout: seconds before an incomplete round fails for everyone.
      engine_threads: threads that sum payloads (each key is pinned to one).
      deterministic: sum in rank order for bitwise reproducible results.
      async_mode: hold parameters and add deltas without rounds (BytePS
        async); see `_async_store`.
    """

    def __init__(
        self,
        num_workers: int,
        *,
        job_id: str | None = None,
        round_timeout: float = 60.0,
        engine_threads: int = 2,
        deterministic: bool = False,
        async_mode: bool = False,
    ):
        self.job_id = job_id
        self.incarnation = secrets.token_hex(8)
        self.async_mode = async_mode
        store_type = _async_store.AsyncStore if async_mode else _store.Store
        self.store = store_type(
            num_workers,
            round_timeout=round_timeout,
            engine_threads=engine_threads,
            deterministic=deterministic,
            encode=self._encode_reply,
        )
        # pushes handed to each engine and not completed yet
        self._engine_jobs = [0] * max(1, engine_threads)
        self._engines = [
            concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"jaxps-engine-{i}"
            )
            for i in range(max(1, engine_threads))
        ]
        #: shared-memory segments of workers on this host
        self.segments = _shm.Segments()
        self._in_slot = _codec.encode_pull_reply(
            self.incarnation, None, in_slot=True
        )

    def _encode_reply(self, total) -> bytes:
        return _codec.encode_pull_reply(self.incarnation, total)

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
        }
        return grpc.method_handlers_generic_handler(_wire.SERVICE_NAME, methods)

    # -- request checks ------------------------------------------------------

    def _check_header(self, h: pb.Header) -> None:
        if h.version != _wire.PROTOCOL_VERSION:
            raise _store.StoreError(
                "FAILED_PRECONDITION",
                f"protocol version mismatch: worker speaks version "
                f"{h.version}, server speaks {_wire.PROTOCOL_VERSION}; "
                "install the same jaxps on workers and servers.",
            )
        if self.job_id is None:
            self.job_id = h.job_id
        elif h.job_id != self.job_id:
            raise _store.StoreError(
                "PERMISSION_DENIED",
                f"unknown job_id {h.job_id!r}: this server serves job "
                f"{self.job_id!r}.",
            )

    async def _abort(self, context, err: _store.StoreError):
        code = _CODES.get(err.code) or getattr(grpc.StatusCode, err.code)
        # Lets a worker tell "rejected" from "rejected by a restarted server".
        context.set_trailing_metadata(
            ((_wire.INCARNATION_KEY, self.incarnation),)
        )
        await context.abort(code, err.message)

    # -- RPCs --------------------------------------------------------------

    async def Hello(self, request: bytes, context):
        try:
            request = _decode(pb.HelloRequest, request)
            self._check_header(
                pb.Header(version=request.version, job_id=request.job_id)
            )
            self.store.check_rank(request.rank)
            if request.num_workers != self.store.num_workers:
                raise _store.StoreError(
                    "FAILED_PRECONDITION",
                    f"wrong num_workers: worker {request.rank} says "
                    f"num_workers={request.num_workers}, server was started "
                    f"with --num-workers {self.store.num_workers}.",
                )
        except _store.StoreError as err:
            await self._abort(context, err)
        return pb.HelloReply(
            version=_wire.PROTOCOL_VERSION,
            incarnation=self.incarnation,
            num_workers=self.store.num_workers,
            job_id=self.job_id,
            async_mode=self.async_mode,
        )

    async def Push(self, request: bytes, context):
        try:
            await self._push(*self._decode_push(request))
        except _store.StoreError as err:
            await self._abort(context, err)
        return pb.PushReply(incarnation=self.incarnation)

    async def Pull(self, request: bytes, context) -> bytes:
        try:
            request = _decode(pb.PullRequest, request)
            h = request.header
            self._check_header(h)
            slot = request.slot if request.HasField("slot") else None
            target = None if slot is None else self._slot(h, slot)
            result = await self._pull(h, target, context)
        except _store.StoreError as err:
            await self._abort(context, err)
        return result  # an encoded PullReply

    async def PushPull(self, request: bytes, context) -> bytes:
        """Push from a shared-memory slot, then Pull into it, in one call."""
        try:
            h, payload, checksum, slot = self._decode_push(request)
            if slot is None:
                raise _store.StoreError(
                    "INVALID_ARGUMENT",
                    f"PushPull of key {h.key} round {h.round} by rank "
                    f"{h.rank} names no shared-memory slot; use Push and "
                    "Pull for payloads in messages.",
                )
            target = await self._push(h, payload, checksum, slot)
            await self._pull(h, target, context)
        except _store.StoreError as err:
            await self._abort(context, err)
        return self._in_slot

    def _decode_push(self, request: bytes):
        try:
            h, payload, checksum, slot = _codec.decode_push(request)
        except _codec.DecodeError as err:
            raise _store.StoreError(
                "INVALID_ARGUMENT", f"malformed PushRequest: {err}"
            ) from None
        self._check_header(h)
        return h, payload, checksum, slot

    async def _push(self, h: pb.Header, payload, checksum: int, slot):
        """Accepts a push; returns its payload (a slot's memory if lent)."""
        if slot is not None:
            payload = self._slot(h, slot)
        ticket = self.store.begin_push(
            **_chunk(h),
            payload=payload,
            checksum=checksum,
            name=h.name,
            lent=slot is not None,
        )
        if ticket is None:
            return payload
        # Small pushes, and any push while its engine has nothing queued
        # (a lone chunk waits for it), are summed here: cheaper than the hop
        # to the engine thread and back. A key's pushes stay in order.
        if (
            ticket.data.nbytes <= INLINE_SUM_BYTES
            or self._engine_jobs[ticket.engine] == 0
        ):
            try:
                ticket.run()
            except Exception as err:
                if self.async_mode:  # a delta may be refused
                    raise
                self._complete(ticket, err)
            else:
                self._complete(ticket, None)
            return payload
        self._engine_jobs[ticket.engine] += 1
        summed = asyncio.get_running_loop().run_in_executor(
            self._engines[ticket.engine], ticket.run
        )
        if self.async_mode:
            try:
                await summed
            finally:
                self._engine_jobs[ticket.engine] -= 1
            self.store.finish_push(ticket)
        else:
            # The payload stays valid (the request's bytes, or a slot lent
            # until the pull): acknowledge it now.
            summed.add_done_callback(functools.partial(self._summed, ticket))
        return payload

    def _summed(self, ticket: _store.PushTicket, future) -> None:
        self._engine_jobs[ticket.engine] -= 1
        if not future.cancelled():  # cancelled: the server is stopping
            self._complete(ticket, future.exception())

    def _complete(self, ticket: _store.PushTicket, err) -> None:
        """Completes a summed push, or fails its round if summing raised."""
        if err is None:
            self.store.finish_push(ticket)
        else:
            log.error("summing a push failed: %r", err)
            self.store.fail_push(ticket, err)

    async def _pull(self, h: pb.Header, target, context):
        """The encoded PullReply of a rank's round, once it is complete;
        with `target` (a slot), the sum is put there instead."""
        store = self.store
        rnd, result = store.pull(**_chunk(h), into=target)
        if result is None:
            await self._wait(rnd, context)
            store.fail_if_late(h.key, rnd, time.monotonic())
            result = store.collect(h.key, rnd, h.rank, into=target)
        return self._in_slot if target is not None else result

    def _slot(self, h: pb.Header, slot: pb.ShmSlot) -> memoryview:
        """The bytes of a chunk in a worker's shared-memory slot."""
        try:
            itemsize = _wire.code_dtype(h.dtype).itemsize
        except KeyError:
            itemsize = 0  # the store names the bad dtype
        return self.segments.view(
            h.rank, slot.segment, slot.offset, h.length * itemsize
        )

    async def Attach(self, request: bytes, context):
        try:
            request = _decode(pb.AttachRequest, request)
            self._check_header(request.header)
            self.store.check_rank(request.header.rank)
            segment = self.segments.attach(
                request.header.rank, request.name, request.size, request.token
            )
        except _store.StoreError as err:
            await self._abort(context, err)
        return pb.AttachReply(incarnation=self.incarnation, segment=segment)

    async def Detach(self, request: bytes, context):
        try:
            request = _decode(pb.DetachRequest, request)
            self._check_header(request.header)
            self.segments.detach(request.header.rank, request.segments)
        except _store.StoreError as err:
            await self._abort(context, err)
        return pb.DetachReply(incarnation=self.incarnation)

    async def _wait(self, rnd: _store.Round, context) -> None:
        event = asyncio.Event()
        rnd.waiters.append(event.set)
        timeout = self.store.deadline(rnd) - time.monotonic()
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, remaining)
        try:
            await asyncio.wait_for(event.wait(), max(0.0, timeout))
        except asyncio.TimeoutError:
            pass  # the caller checks whether the round failed

    async def expire_forever(self, period: float = 1.0) -> None:
        """Fails late rounds every `period` seconds (a background task)."""
        while True:
            await asyncio.sleep(period)
            failed = self.store.expire()
            if failed:
                log.warning("%d round(s) timed out", failed)

    def close(self) -> None:
        for engine in self._engines:
            engine.shutdown(wait=False, cancel_futures=True)
        self.segments.close()
