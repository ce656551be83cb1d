"""The interface of a transport: how chunks get to a server and back.

A transport carries the chunks of one server client (one channel): the
payload goes to the server, and the sum of all workers comes back into the
chunk's dest. `Transport` says what every transport must guarantee and
holds what they share: `_complete` ends a chunk the same way for all of
them. The transports are `grpc.GrpcTransport` (payloads in the gRPC
messages), `shm.ShmTransport` (payloads in shared-memory slots) and
`data.DataTransport` (payloads on the server's data channel);
`runtime.make_transport` picks one per server client.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jaxps._src import errors
from jaxps._src import timeline as _timeline
from jaxps._src.plan import Gather
from jaxps.servers import _wire

if TYPE_CHECKING:
    from jaxps._src.transport.client import ServerClient
    from jaxps.servers import jaxps_pb2 as pb


#: Seconds a rank's abort of a round may take (see `Transport.abort`).
ABORT_TIMEOUT = 1.0


#: A `Gather` whose parts average fewer bytes is sent joined: each part
#: of a ``sendmsg`` costs a few microseconds of views and an iovec, as
#: much as copying about 20 KiB.
JOIN_BELOW = 32 << 10


def fingerprint(source: np.ndarray | Gather) -> int:
    """The wire checksum of a payload (`_wire.fingerprint`)."""
    if isinstance(source, Gather):
        return _wire.fingerprint_parts(source.parts, source.nbytes)
    return _wire.fingerprint_parts((source,))


def parts_of(source: np.ndarray | Gather) -> tuple[np.ndarray, ...]:
    """The arrays that make a payload, in order, to send: a `Gather` of
    small parts (see `JOIN_BELOW`) joined into one."""
    if not isinstance(source, Gather):
        return (source,)
    if source.nbytes < JOIN_BELOW * len(source.parts):
        return (source.joined(),)
    return source.parts


def pull_deadline(timeout: float) -> float:
    """Client deadline of a pull: past the server's round timeout, so the
    server's message naming the missing ranks arrives first."""
    return 1.25 * timeout + 2.0


class ChunkHandle(Protocol):
    """Who hears how a chunk ended: a push_pull's `runtime.Handle`, or what
    stands in for it (a call check's, a failover attempt's)."""

    def chunk_done(self) -> None:
        """The chunk's sum is in its dest."""

    def fail(self, err: BaseException) -> None:
        """The chunk failed with `err`."""

    @property
    def failed(self) -> bool:
        """Whether the chunk need not be sent any more."""

    @property
    def error(self) -> BaseException | None:
        """Why the call failed (its first error), or None."""


class Chunk:
    """One piece of a push_pull on its way to a server and back.

    Attributes:
      queued: when it was queued (a `timeline.now()` time).
      handle: told once how it ended (a `ChunkHandle`).
      source: the payload, a flat array or a `plan.Gather` of several
        (read-only to the transport; `plan.payload` joins a Gather).
      dest: where the sum goes, a flat array of the same dtype and size.
      header: the wire header (key, round, dtype, length, name, ...).
      divisor: None to keep the sum; else the sum is averaged: divided by
        the number of ranks it is over, which the server says (fewer than
        the workers while some have joined), or by `divisor` (the number
        of workers) where it does not say.
      nbytes: the payload's size, the credit it holds while pushed.
      transport: the transport of the server client it goes to.
      private: whether `source` is the runtime's own (never written by
        the caller), so failover may keep it instead of a copy.
    """

    __slots__ = (
        "queued",
        "handle",
        "source",
        "dest",
        "header",
        "divisor",
        "nbytes",
        "transport",
        "private",
    )

    def __init__(
        self,
        handle: ChunkHandle,
        source: np.ndarray | Gather,
        dest: np.ndarray,
        header: pb.Header,
        divisor: int | None,
        transport: Transport,
        private: bool = False,
    ):
        self.queued = _timeline.now()
        self.handle = handle
        self.source = source
        self.dest = dest
        self.header = header
        self.divisor = divisor
        self.nbytes = source.nbytes
        self.transport = transport
        self.private = private


class Credit(Protocol):
    """What the sender lends a transport along with a chunk."""

    def release(self, nbytes: int) -> None:
        """Gives back the credit of a chunk's `nbytes`."""

    def may_block(self) -> bool:
        """Whether the calling sender thread may wait for a round; if
        True, `unblock` must follow once it stops waiting."""

    def unblock(self) -> None:
        """Ends a wait that `may_block` allowed."""


class _Spent:
    """The `Credit` of a chunk sent again, whose credit already went back:
    nothing to give back, and it never waits for a round."""

    def release(self, nbytes: int) -> None:
        del nbytes

    def may_block(self) -> bool:
        return False

    def unblock(self) -> None:
        pass


#: The credit of every chunk that is sent again (failover, a data channel
#: that broke): its own credit went back with the first send.
SPENT: Credit = _Spent()


class Transport(abc.ABC):
    """Carries the chunks of one server client and brings their sums back.

    `send` runs on a sender thread, with the chunk's credit taken. For every
    chunk a transport must:

    - give the credit back (``credit.release(chunk.nbytes)``) exactly once,
      as soon as the server has the bytes or the push failed, and never
      hold it while waiting for other workers;
    - write the sum into ``chunk.dest``, averaged if ``chunk.divisor`` is
      not None (over the contributors the server names), and end the
      chunk with exactly one of ``chunk.handle.chunk_done()`` or
      ``chunk.handle.fail(err)``, where
      `err` is a `JaxpsError` naming the server and the chunk: both through
      `_complete`, which also checks the size and records the ``pull`` span;
    - put a deadline on every wait: ``timeout`` for a push, `pull_deadline`
      of it for a wait on a round;
    - block the sender thread on a round only if ``credit.may_block()``
      allowed it (and call ``credit.unblock()`` after), so another sender
      thread stays free to send the chunks other workers wait for;
    - never reuse memory that a failed chunk lent to the server: a late
      server write could still land in it.

    Args:
      client: the gRPC client of the server (hello already done).
      timeline: where the ``queue``/``push``/``pull`` spans go, or None.
    """

    def __init__(self, client: ServerClient, timeline=None):
        self.client = client
        self.timeline = timeline
        self.row = f"server {client.address}"

    @property
    def address(self) -> str:
        """The server's ``host:port``, for messages."""
        return self.client.address

    @property
    def timeout(self) -> float:
        """Seconds a push (or the wait for its credit) may take."""
        return self.client.timeout

    @abc.abstractmethod
    def send(self, chunk: Chunk, credit: Credit) -> None:
        """Pushes `chunk` (its credit is taken) and has its sum pulled;
        may return before the sum is back."""

    def abort(self, chunk: Chunk) -> None:
        """Tells the server that this rank will not push `chunk` (its call
        failed), so the other ranks hear it now rather than at the round
        timeout. Best effort, within `ABORT_TIMEOUT`."""
        err = chunk.handle.error
        self.client.abort(
            chunk.header,
            f"{type(err).__name__}: {err}" if err is not None else "",
            ABORT_TIMEOUT,
        )

    def close(self) -> None:
        """Frees what the transport holds; called once no chunk is sent."""
        self.client.close()

    def _span(self, stage: str, start: float, chunk: Chunk) -> float:
        """Records `stage` of `chunk` from `start` to now; returns now."""
        end = _timeline.now()
        if self.timeline is not None:
            h = chunk.header
            self.timeline.span(
                stage,
                self.row,
                start,
                end,
                chunk=h.name,
                round=h.round,
                bytes=chunk.nbytes,
            )
        return end

    def _complete(
        self,
        chunk: Chunk,
        pulling: float,
        receive: Callable[[], tuple[np.ndarray, int]],
        keep: Callable[[], None] | None = None,
    ) -> None:
        """Ends `chunk`, once: ``receive()`` waits for the sum (an array of
        dest's dtype) and how many ranks it is over (0: not said); the sum
        goes into dest, averaged if the chunk has a divisor, then
        `keep` runs (e.g. gives a slot back), the ``pull`` span from
        `pulling` is recorded and the handle hears `chunk_done`. Any error
        of `receive` or of the write fails the handle instead, and `keep`
        does not run: memory lent to the server is not reused."""
        h, dest = chunk.header, chunk.dest
        try:
            data, contributors = receive()
            if data.size != dest.size:
                raise errors.RequestRejectedError(
                    f"server {self.address} answered {h.name} round "
                    f"{h.round} with {data.size} elements, expected "
                    f"{dest.size}."
                )
            if chunk.divisor is None:
                if data is not dest:  # (the data channel receives in dest)
                    dest[...] = data
            else:
                np.divide(data, contributors or chunk.divisor, out=dest)
        except BaseException as err:  # noqa: BLE001 - reported to the waiter
            chunk.handle.fail(err)
            return
        if keep is not None:
            keep()
        self._span("pull", pulling, chunk)
        chunk.handle.chunk_done()
