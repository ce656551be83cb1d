"""The sender: one priority queue, a credit and the sender threads.

All chunks of a worker wait in one priority queue, whatever their server;
sender threads take them in order, within a credit bound on the bytes being
pushed at once, and hand each to its transport. Every worker thus pushes in
the same order, so each server gets a chunk from all workers at about the
same time and can answer its pulls early, instead of every server waiting
for the worker that happened to serve it last. Credit never waits on other
workers, so workers that queue chunks in different orders cannot deadlock
each other.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref

from jaxps._src import errors
from jaxps._src.transport.base import Chunk

_STOP = object()


class _Lent:
    """The credit of one chunk as its transport sees it: given back at most
    once, and settled by the sender if the transport raised."""

    __slots__ = ("sender", "released", "blocked")

    def __init__(self, sender: Sender):
        self.sender = sender
        self.released = False
        self.blocked = 0

    def release(self, nbytes: int) -> None:
        if not self.released:
            self.released = True
            self.sender.release(nbytes)

    def may_block(self) -> bool:
        if self.sender.may_block():
            self.blocked += 1
            return True
        return False

    def unblock(self) -> None:
        self.blocked -= 1
        self.sender.unblock()

    def settle(self, nbytes: int) -> None:
        """Gives back what a transport that raised still holds."""
        self.release(nbytes)
        while self.blocked > 0:
            self.unblock()


class Sender:
    """The queue, credit and sender threads of a worker, for all servers.

    Args:
      credit: most bytes being pushed at once (a larger chunk still goes
        out alone).
      threads: number of sender threads.
    """

    def __init__(self, credit: int, threads: int):
        self.credit = credit
        self.in_flight = 0
        self._blocked = 0  # sender threads waiting for a round
        self._cv = threading.Condition()
        # One sender thread at a time, the taker, waits on the queue and
        # takes credit, so credit is taken in priority order. It keeps the
        # role through its send unless a chunk is queued meanwhile: a
        # chunk then wakes one other thread (`put`), so a send that blocks
        # holds nothing up, and one that does not costs no handoff.
        self._taker = threading.Condition(threading.Lock())
        self._taken = False  # a thread has the taker's role
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        # calls whose failure a server was told of: once is enough, since
        # another rank's call fails as soon as any of its rounds does
        self._aborted: weakref.WeakSet = weakref.WeakSet()
        self.threads = [
            threading.Thread(
                target=self._send_loop, daemon=True, name=f"jaxps-send-{i}"
            )
            for i in range(threads)
        ]
        for t in self.threads:
            t.start()

    def set_credit(self, credit: int) -> None:
        """Changes the credit (for the chunks that take credit from now)."""
        with self._cv:
            self.credit = credit
            self._cv.notify_all()

    def put(self, order: tuple, chunk: Chunk) -> None:
        """Queues `chunk`; the smallest `order` goes out first."""
        self._queue.put((*order, chunk))
        with self._taker:
            if not self._taken:  # the taker is sending: wake another
                self._taker.notify()

    def _take_role(self) -> None:
        with self._taker:
            while self._taken:
                self._taker.wait()
            self._taken = True

    def _give_role(self) -> None:
        with self._taker:
            self._taken = False
            if not self._queue.empty():
                self._taker.notify()

    def acquire(self, nbytes: int, timeout: float, label: str) -> None:
        """Takes credit for `nbytes`, waiting at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self.in_flight > 0 and self.in_flight + nbytes > self.credit:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise errors.RoundTimeoutError(
                        f"{label}: no credit to push within {timeout:g} s "
                        f"({self.in_flight} bytes pushed to the servers and "
                        "not acknowledged)."
                    )
                self._cv.wait(remaining)
            self.in_flight += nbytes

    def release(self, nbytes: int) -> None:
        """Gives back the credit of `nbytes`."""
        with self._cv:
            self.in_flight -= nbytes
            self._cv.notify_all()

    def may_block(self) -> bool:
        """Whether the calling sender thread may wait for a round (and
        counts it as waiting until `unblock`): only while another sender
        thread stays free to send the chunks other workers wait for."""
        with self._cv:
            if self._blocked + 1 < len(self.threads):
                self._blocked += 1
                return True
            return False

    def unblock(self) -> None:
        """Ends a wait that `may_block` allowed."""
        with self._cv:
            self._blocked -= 1

    def _send_loop(self) -> None:
        while True:
            self._take_role()
            try:  # credit is taken in priority order
                chunk = self._queue.get()[-1]
                if chunk is _STOP:
                    return
                aborted = chunk.handle.failed
                h, transport = chunk.header, chunk.transport
                if not aborted:
                    try:
                        self.acquire(
                            chunk.nbytes,
                            transport.timeout,
                            f"push_pull of {h.name} round {h.round} to "
                            f"server {transport.address}",
                        )
                    except errors.JaxpsError as err:
                        chunk.handle.fail(err)
                        aborted = True
            finally:
                self._give_role()
            if aborted:  # its call failed: the other ranks hear it now
                self._abort(chunk)
                continue
            lent = _Lent(self)
            try:
                transport.send(chunk, lent)
            except BaseException as err:  # noqa: BLE001 - the thread goes on
                lent.settle(chunk.nbytes)
                chunk.handle.fail(_send_failed(chunk, err))
                self._abort(chunk)

    def _abort(self, chunk: Chunk) -> None:
        """Tells `chunk`'s server its round is given up, once per call
        (never raises: at worst the other ranks time out)."""
        try:
            with self._cv:
                if chunk.handle in self._aborted:
                    return
                self._aborted.add(chunk.handle)
            chunk.transport.abort(chunk)
        except Exception:  # noqa: BLE001 - best effort, never the thread's end
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """Stops the sender threads (after the chunks queued before),
        waiting at most `timeout` s for all of them together: a thread
        still waiting for a round (e.g. of a push_pull that failed) ends
        when its channel closes."""
        for _ in self.threads:
            self.put((float("inf"), 0, 0), _STOP)
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))


def _send_failed(chunk: Chunk, err: BaseException) -> errors.JaxpsError:
    """The error of a chunk whose transport raised `err` (chained)."""
    if isinstance(err, errors.JaxpsError):
        return err
    h = chunk.header
    failed = errors.JaxpsError(
        f"push_pull of {h.name} round {h.round} to server "
        f"{chunk.transport.address}: sending failed: {err!r}"
    )
    failed.__cause__ = err
    return failed
