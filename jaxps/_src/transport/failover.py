"""Server failover: a restarted server loses no step (synchronous mode).

In synchronous mode a server holds nothing that the workers cannot give it
again, only the rounds in flight. `RecoveringTransport` wraps the transport
of one server client. When a chunk fails because the server restarted
(`ServerRestartedError`) or stopped answering (`ServerUnavailableError`),
it connects again within the recovery window (a fresh Hello: the workers
meet in a new job incarnation of the new server process, shared memory is
attached anew), pushes again, without pulling, the last completed round of
every key it sent to that server, and then sends the failed chunk again.

Why the re-push of completed rounds: a rank pulls only once a round is
complete, so after a crash some ranks may hold a round's sum that others
never got. Those others push the round again to the new server; the ranks
that already have it push their payload again too, so that the round can
complete, and do not pull it. The new server starts each key at the round
of its first push; exactly-once dedupe makes every repeat harmless, and a
re-push that the new server refuses (its key already started later) is
dropped, since no rank waits for that round. A lagging rank's re-push that
came first, of a round the others hold and never push again, is abandoned
by the server once they push past it.

The cost: each key's last payload to the server is kept (one copy of the
gradients per worker, refreshed in place every round).

One thread per recovering server does the work: it reconnects and
re-pushes outside the transport's lock, then sends again every chunk that
failed or arrived meanwhile. Those give their credit back while they wait,
and sender threads never wait for a recovery, so the other servers' chunks
go on at their normal pace.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from jaxps._src import errors, plan
from jaxps._src.transport.base import (
    SPENT,
    Chunk,
    Credit,
    Transport,
    fingerprint,
)
from jaxps.servers import jaxps_pb2 as pb

log = logging.getLogger("jaxps")

#: Errors after which the server may be back with nothing of this job.
RECOVERABLE = (errors.ServerRestartedError, errors.ServerUnavailableError)
#: Seconds a push or pull retries UNAVAILABLE before the chunk fails over:
#: the wait for a restarting server is then the recovery's, off the sender
#: threads and without the chunk's credit (`client.RETRY_WINDOW` without
#: failover).
RETRY_WINDOW = 0.25


class _Attempt:
    """The `ChunkHandle` of one attempt to send a chunk: keeps its payload
    once done, fails over if it failed."""

    __slots__ = ("owner", "chunk", "generation", "__weakref__")

    def __init__(self, owner: RecoveringTransport, chunk: Chunk, generation):
        self.owner, self.chunk, self.generation = owner, chunk, generation

    def chunk_done(self) -> None:
        self.owner._keep(self.chunk)
        self.chunk.handle.chunk_done()

    def fail(self, err: BaseException) -> None:
        self.owner._failed(self.chunk, err, self.generation)

    @property
    def failed(self) -> bool:
        return self.chunk.handle.failed

    @property
    def error(self) -> BaseException | None:
        return self.chunk.handle.error


class RecoveringTransport(Transport):
    """A transport that reconnects to a restarted server and goes on.

    Args:
      first: the transport of the first connection.
      reconnect: makes a new transport, after a fresh hello that waits up to
        the seconds it is given (raises a `JaxpsError` while the server is
        not back).
      window: seconds from a failure within which the server must be back.
    """

    def __init__(
        self,
        first: Transport,
        reconnect: Callable[[float], Transport],
        window: float,
    ):
        super().__init__(first.client, first.timeline)
        first.client.retry_window = RETRY_WINDOW
        self._inner = first
        self._reconnect = reconnect
        self._window = window
        self._lock = threading.Lock()
        self._generation = 0
        self._closed = False
        # chunks to send again once recovered, and the recovery's state
        self._waiting: list[Chunk] = []
        self._failure: tuple[BaseException, float] | None = None
        self._draining = False
        self._replaced: list[Transport] = []  # closed with this one
        # key -> (header, payload, whether it is the chunk's own source) of
        # its last completed round here
        self._kept: dict[int, tuple[pb.Header, np.ndarray, bool]] = {}
        #: seconds each recovery took, failure to the new transport
        self.recoveries: list[float] = []

    @property
    def current(self) -> Transport:
        """The transport in use now."""
        return self._inner

    def __getattr__(self, name):
        # what only the transport in use has (a shm pool, a data channel)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def forget_rounds(self) -> None:
        """Drops the kept payloads: every key starts again at round 0
        (after `jaxps.join`), so no kept round can be asked for again."""
        with self._lock:
            self._kept.clear()

    def send(self, chunk: Chunk, credit: Credit) -> None:
        with self._lock:
            recovering = self._failure is not None
            if recovering:
                self._waiting.append(chunk)
            inner, generation = self._inner, self._generation
        if recovering:  # it waits without holding the others' credit
            credit.release(chunk.nbytes)
            return
        self._send(inner, chunk, credit, generation)

    def _send(self, inner, chunk: Chunk, credit, generation) -> None:
        attempt = Chunk(
            _Attempt(self, chunk, generation),
            chunk.source,
            chunk.dest,
            chunk.header,
            chunk.divisor,
            inner,
            chunk.private,
        )
        attempt.queued = chunk.queued
        try:
            inner.send(attempt, credit)
        except Exception as err:  # noqa: BLE001 - e.g. its channel closed
            self._failed(chunk, err, generation)

    def _keep(self, chunk: Chunk) -> None:
        """Keeps a completed chunk's payload (a copy unless the runtime owns
        it), for a re-push."""
        key = chunk.header.key
        source = chunk.source
        with self._lock:
            kept = self._kept.get(key)
            if chunk.private:  # no one writes to it: keep it as it is
                payload = source
            else:  # into the last copy, if it was one this made
                payload = None if kept is None or kept[2] else kept[1]
                if (
                    payload is None
                    or payload.size != source.size
                    or payload.dtype != source.dtype
                ):
                    payload = np.empty(source.size, source.dtype)
                plan.copy_payload(source, payload)
            # The header as it is (it is not changed once its chunk is
            # done): CopyFrom into one kept message would grow its arena.
            self._kept[key] = (chunk.header, payload, chunk.private)

    def _failed(self, chunk: Chunk, err: BaseException, generation) -> None:
        # A chunk of a replaced transport fails however its closed channel
        # makes it fail: it is sent again all the same.
        with self._lock:
            stale = generation != self._generation
            if self._closed or not (stale or isinstance(err, RECOVERABLE)):
                start = None
            else:
                self._waiting.append(chunk)
                if not stale and self._failure is None:
                    self._failure = (err, time.monotonic())
                start, self._draining = not self._draining, True
        if start is None:
            chunk.handle.fail(err)
        elif start:  # not on the transport's own thread (its reader)
            threading.Thread(
                target=self._drain, name="jaxps-failover", daemon=True
            ).start()

    def _drain(self) -> None:
        """Recovers if a failure asks for it, then sends the waiting chunks
        again; until none is left."""
        while True:
            with self._lock:
                failure = self._failure
            if failure is not None:
                try:
                    self._recover(*failure)
                except BaseException as final:  # noqa: BLE001 - to the waiters
                    with self._lock:
                        waiting, self._waiting = self._waiting, []
                        self._failure, self._draining = None, False
                    for chunk in waiting:
                        chunk.handle.fail(final)
                    return
            with self._lock:
                if self._failure is not None:
                    continue  # it failed again meanwhile: recover again
                waiting, self._waiting = self._waiting, []
                if not waiting:
                    self._draining = False
                    return
                inner, generation = self._inner, self._generation
            for chunk in waiting:
                if chunk.handle.failed:
                    continue
                self._send(inner, chunk, SPENT, generation)

    def _recover(self, err: BaseException, failed_at: float) -> None:
        """Connects again and re-pushes the kept rounds, then puts the new
        transport in place. Holds the lock only to swap.

        The old transport is closed only with this one: sender threads may
        still be sending on it, and its chunks fail over to the new one."""
        deadline = failed_at + self._window
        last = err
        while True:
            if self._closed:
                raise err
            try:
                # within the window: a hello waits for the server to be back
                inner = self._reconnect(max(0.1, deadline - time.monotonic()))
                break
            except errors.JaxpsError as again:
                last = again
            if time.monotonic() >= deadline:
                raise errors.ServerUnavailableError(
                    f"server {self.address} did not come back within the "
                    f"recovery window ({self._window:g} s) after: {err}; "
                    f"last attempt: {last}"
                ) from err
            time.sleep(0.2)
        inner.client.retry_window = RETRY_WINDOW
        with self._lock:
            kept = list(self._kept.values())
        repushed = 0
        push_deadline = time.monotonic() + inner.timeout
        for header, payload, _ in kept:
            h = pb.Header()
            h.CopyFrom(header)
            payload = plan.payload(payload)
            try:
                inner.client.push(
                    h, payload, fingerprint(payload), push_deadline
                )
                repushed += 1
            except errors.JaxpsError as refused:
                # e.g. the new server started the key at a later round: no
                # rank waits for this one
                log.debug("jaxps: re-push of %s refused: %s", h.name, refused)
        with self._lock:
            self._replaced.append(self._inner)
            self._inner = inner
            self._generation += 1
            self.client = inner.client
            self._failure = None
        took = time.monotonic() - failed_at
        self.recoveries.append(took)
        log.warning(
            "jaxps: server %s came back (%s); connected again and pushed "
            "%d completed round(s) again, %.2f s after the failure",
            self.address,
            type(err).__name__,
            repushed,
            took,
        )

    def close(self) -> None:
        self._closed = True
        with self._lock:
            transports = (*self._replaced, self._inner)
        # outside the lock: closing fails their chunks, which lands in
        # `_failed` (and so the lock) on this thread
        for transport in transports:
            try:
                transport.close()
            except Exception:  # noqa: BLE001 - a dead connection
                if transport is transports[-1]:
                    raise
