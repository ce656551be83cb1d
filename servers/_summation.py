"""The summation service without gRPC: checks, push, pull and expiry.

`Summation` is what every transport of the server calls: the gRPC
servicer (`_service`) and the data channel (`_data`) only decode requests,
call it and encode its answers. A request is refused by raising
`_wire.Rejected`. All its methods run on the server's event loop.

A chunk's header `h` is any object with the attributes of `pb.Header`:
``version``, ``job_id``, ``rank``, ``key``, ``round``, ``dtype``,
``length`` and ``name``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import numpy as np

from . import _async_store, _codec, _engine, _shm, _store, _wire

log = logging.getLogger("jaxps.server")


def _chunk(h) -> dict:
    """The header fields that name a chunk's round, as the store's
    keyword arguments."""
    return dict(
        key=h.key,
        round=h.round,
        rank=h.rank,
        dtype_code=h.dtype,
        length=h.length,
    )


class Summation:
    """Sums the chunks pushed by `num_workers` ranks and answers pulls.

    Args:
      num_workers: number of worker ranks in the job.
      job_id: the job this server serves; ``None`` adopts the job id of the
        first header checked.
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
        #: Random id of this server process, sent with every reply.
        self.incarnation = secrets.token_hex(8)
        self.async_mode = async_mode
        self.store: _store.PushPullStore
        if async_mode:
            self.store = _async_store.AsyncStore(
                num_workers,
                engine_threads=engine_threads,
                encode=self._encode_reply,
            )
        else:
            self.store = _store.Store(
                num_workers,
                round_timeout=round_timeout,
                engine_threads=engine_threads,
                deterministic=deterministic,
                encode=self._encode_reply,
            )
        self.engines = _engine.Engines(self.store, engine_threads)
        #: Shared-memory segments of workers on this host.
        self.segments = _shm.Segments()
        #: The PullReply of a sum put into the puller's shared-memory slot.
        self.in_slot_reply = _codec.encode_pull_reply(
            self.incarnation, None, in_slot=True
        )

    @property
    def num_workers(self) -> int:
        return self.store.num_workers

    def _encode_reply(self, total) -> bytes:
        return _codec.encode_pull_reply(self.incarnation, total)

    # -- checks ------------------------------------------------------------

    def check_header(self, h) -> None:
        """Checks the protocol version and job id of `h` (the first job id
        checked is adopted if the server was given none)."""
        if h.version != _wire.PROTOCOL_VERSION:
            raise _wire.Rejected(
                "FAILED_PRECONDITION",
                f"protocol version mismatch: worker speaks version "
                f"{h.version}, server speaks {_wire.PROTOCOL_VERSION}; "
                "install the same jaxps on workers and servers.",
            )
        if self.job_id is None:
            self.job_id = h.job_id
        elif h.job_id != self.job_id:
            raise _wire.Rejected(
                "PERMISSION_DENIED",
                f"unknown job_id {h.job_id!r}: this server serves job "
                f"{self.job_id!r}.",
            )

    def check_rank(self, rank: int) -> None:
        """Checks that `rank` is in ``[0, num_workers)``."""
        self.store.check_rank(rank)

    def hello(self, h, num_workers: int) -> None:
        """Checks a worker's hello: header, rank and its `num_workers`."""
        self.check_header(h)
        self.check_rank(h.rank)
        if num_workers != self.num_workers:
            raise _wire.Rejected(
                "FAILED_PRECONDITION",
                f"wrong num_workers: worker {h.rank} says "
                f"num_workers={num_workers}, server was started "
                f"with --num-workers {self.num_workers}.",
            )

    # -- shared memory -----------------------------------------------------

    def attach(self, h, name: str, size: int, token: bytes) -> int:
        """Maps a segment of rank ``h.rank``; returns its id."""
        self.check_header(h)
        self.check_rank(h.rank)
        return self.segments.attach(h.rank, name, size, token)

    def detach(self, h, segments) -> None:
        """Unmaps segments of rank ``h.rank`` (unknown ids are ignored)."""
        self.check_header(h)
        self.segments.detach(h.rank, segments)

    def slot(self, h, slot) -> memoryview:
        """The bytes of chunk `h` in a slot (``segment``, ``offset``) of a
        shared-memory segment of rank ``h.rank``."""
        try:
            itemsize = _wire.code_dtype(h.dtype).itemsize
        except KeyError:
            itemsize = 0  # the store names the bad dtype
        return self.segments.view(
            h.rank, slot.segment, slot.offset, h.length * itemsize
        )

    # -- push and pull -----------------------------------------------------

    async def push(self, h, payload, checksum: int, slot=None):
        """Accepts a push and schedules its sum; returns its payload (the
        memory of `slot` if one is named, which is then lent to the server
        until the rank's pull of the round returns).

        `payload` must stay valid until the round is complete (until the
        caller's pull returns). In async mode it returns once the push was
        added.
        """
        self.check_header(h)
        if slot is not None:
            payload = self.slot(h, slot)
        ticket = self.store.begin_push(
            **_chunk(h),
            payload=payload,
            checksum=checksum,
            name=h.name,
            lent=slot is not None,
        )
        if ticket is not None:  # else an identical retry
            await self.engines.sum(ticket)
        return payload

    async def pull(
        self, h, *, deadline: float, raw: bool = False, into=None
    ) -> bytes | np.ndarray:
        """Waits until the round of `h` is complete; returns its sum.

        The sum comes as an encoded PullReply, or with `raw` as a numpy
        array (valid until the key's round after next is summed). With
        `into` (a writable buffer, e.g. the slot the push was lent from) the
        sum is put there and the reply says so (with `raw`: a numpy view of
        `into`). Raises DEADLINE_EXCEEDED, naming the ranks that did not
        push, if the round is incomplete at `deadline` (a
        `time.monotonic()` value) or at the round's own deadline.
        """
        self.check_header(h)
        store = self.store
        rnd, result = store.pull(**_chunk(h), raw=raw, into=into)
        if result is None:
            await self._wait(rnd, deadline)
            result = store.collect(
                h.key, rnd, h.rank, raw=raw, into=into, now=time.monotonic()
            )
        if into is None:
            return result
        if raw:
            return np.frombuffer(into, _wire.code_dtype(h.dtype), h.length)
        return self.in_slot_reply

    @staticmethod
    async def _wait(rnd, deadline: float) -> None:
        event = asyncio.Event()
        rnd.waiters.append(event.set)
        timeout = min(rnd.deadline, deadline) - time.monotonic()
        try:
            await asyncio.wait_for(event.wait(), max(0.0, timeout))
        except asyncio.TimeoutError:
            pass  # `collect` tells whether the round failed

    # -- life --------------------------------------------------------------

    async def expire_forever(self, period: float = 1.0) -> None:
        """Fails late rounds every `period` seconds (a background task)."""
        while True:
            await asyncio.sleep(period)
            failed = self.store.expire()
            if failed:
                log.warning("%d round(s) timed out", failed)

    def close(self) -> None:
        """Stops the engine threads and unmaps every segment."""
        self.engines.close()
        self.segments.close()
