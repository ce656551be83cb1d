"""Which ranks of a session have joined (`jaxps.join`), epoch by epoch.

A rank that ran out of data joins: the store then completes rounds without
it (`_store.Store.join`). The epoch ends once every rank has joined; then
the store starts its keys again (`Store.reset_rounds`) and nobody is
joined. A Join names its rank's epoch (the joins it completed), so a
retried Join of an ended epoch is answered again instead of joining the
next one.
"""

from __future__ import annotations

from collections.abc import Callable

from . import _wire


class JoinBarrier:
    """The joined ranks of one session's current epoch.

    Args:
      num_workers: ranks in the session.
    """

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.epoch = 0  # epochs ended so far
        self.joined: dict[int, None] = {}  # in the order they joined
        self.last = -1  # the rank that ended the last epoch
        self._waiters: list[Callable[[], None]] = []

    def join(self, rank: int, epoch: int) -> bool:
        """Rank `rank` joins `epoch`; returns True if that ended the epoch
        (the caller then resets the store and calls `end`). A join of an
        ended epoch is a retry and changes nothing."""
        if epoch > self.epoch:
            raise _wire.Rejected(
                "FAILED_PRECONDITION",
                f"join of rank {rank} names epoch {epoch}, but this server "
                f"has seen only {self.epoch} epoch(s) end (was it "
                "restarted?).",
            )
        if epoch < self.epoch:
            return False
        self.joined[rank] = None
        return len(self.joined) == self.num_workers

    def end(self) -> None:
        """Ends the epoch: wakes the waiting Joins; nobody is joined."""
        self.last = next(reversed(self.joined))
        self.epoch += 1
        self.joined = {}
        waiters, self._waiters = self._waiters, []
        for wake in waiters:
            wake()

    def wait(self, wake: Callable[[], None]) -> None:
        """Calls `wake` when the current epoch ends."""
        self._waiters.append(wake)

    def missing(self) -> list[int]:
        """The ranks that have not joined the current epoch."""
        return sorted(set(range(self.num_workers)) - set(self.joined))
