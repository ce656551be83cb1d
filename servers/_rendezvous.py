"""Elastic membership: the generations of a job's workers, agreed here.

A worker of an elastic job (`jaxps.elastic`) arrives with the generation it
was in (0: a newcomer) and waits until the next generation closes. One
closes once ``expected`` workers arrived, or ``settle`` seconds after the
last arrival if a member of the current generation is among them: so the
survivors of a lost worker agree without knowing who is lost, and a
newcomer alone never starts a generation while the job runs without it.
Only members count toward ``expected``, and newcomers too while the job is
not running (servers outlive jobs: the next run of a job starts afresh).
Members of the last generation keep their order (rank 0 stays rank 0 if it
is alive); newcomers follow by hint, then by arrival. A member whose reply
was lost and who asks again gets the generation it is in. A server that
restarted adopts the generation its first arrival names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from . import _wire

log = logging.getLogger("jaxps.server")

#: Most workers waiting in one job's rendezvous.
MAX_WAITING = 65536


class Rendezvous:
    """The membership of one elastic job.

    Args:
      job_id: the job.
      running: returns whether the job's last generation is in use (then
        only its members' ``expected`` counts; else newcomers may start a
        new generation by themselves).
    """

    def __init__(self, job_id: str, running: Callable[[], bool]):
        self.job_id = job_id
        self._running = running
        #: the last generation that closed, and its members (rank order)
        self.generation = 0
        self.members: tuple[str, ...] = ()
        # member -> (generation it was in, hint, expected), in arrival order
        self._arrived: dict[str, tuple[int, int, int]] = {}
        self._settle = 0.0
        self._last = 0.0
        self._closed: asyncio.Future | None = None

    @property
    def waiting(self) -> int:
        """Workers waiting for the next generation."""
        return len(self._arrived)

    def _expected(self) -> int:
        arrived = self._arrived.values()
        members = [e for was, _, e in arrived if was == self.generation]
        if members or self._running():
            return max(members, default=0)
        return max(e for _, _, e in arrived)

    def _closable(self, now: float) -> bool:
        if not self._arrived:
            return False
        expected = self._expected()
        if expected and len(self._arrived) >= expected:
            return True
        current = self.generation > 0 and any(
            was == self.generation for was, _, _ in self._arrived.values()
        )
        return current and now - self._last >= self._settle

    def _close(self) -> None:
        old = [m for m in self.members if m in self._arrived]
        new = sorted(
            (m for m in self._arrived if m not in self.members),
            key=lambda m: self._arrived[m][1],
        )  # stable: ties keep their arrival order
        self.generation += 1
        self.members = tuple(old + new)
        self._closed.set_result((self.generation, self.members))
        self._closed = None
        self._arrived = {}
        self._settle = 0.0

    async def arrive(
        self,
        member: str,
        was: int,
        *,
        expected: int,
        settle: float,
        hint: int,
        deadline: float,
    ) -> tuple[int, tuple[str, ...]]:
        """Waits for the next generation; returns it and its members.

        Raises DEADLINE_EXCEEDED at `deadline` (a `time.monotonic()`
        value), saying how many workers arrived and what closes it.
        """
        if not member:
            raise _wire.Rejected(
                "INVALID_ARGUMENT", "rendezvous names no member."
            )
        if was > self.generation:
            if self.generation or self._arrived:
                raise _wire.Rejected(
                    "FAILED_PRECONDITION",
                    f"member {member} of job {self.job_id!r} says it was in "
                    f"generation {was}, but the job's last is "
                    f"{self.generation}.",
                )
            # This server restarted and lost the membership: its members
            # bring the generation back; their hints (ranks) order them.
            log.info("job %r: generation %d adopted", self.job_id, was)
            self.generation = was
        if was < self.generation and member in self.members:
            return self.generation, self.members  # a retry: its reply
        if member not in self._arrived and self.waiting >= MAX_WAITING:
            raise _wire.Rejected(
                "RESOURCE_EXHAUSTED",
                f"{self.waiting} workers wait in the rendezvous of job "
                f"{self.job_id!r}, the most it takes.",
            )
        now = time.monotonic()
        if self._closed is None:
            self._closed = asyncio.get_running_loop().create_future()
        closed = self._closed
        self._arrived[member] = (was, hint, expected)
        self._settle = max(self._settle, settle)
        self._last = now
        while not closed.done():
            if self._closable(now):
                self._close()
                break
            # wake for the settle time, and each second: the job may stop
            wake = min(deadline, now + 1.0)
            if self._settle > 0:
                wake = min(wake, self._last + self._settle)
            try:
                await asyncio.wait_for(
                    asyncio.shield(closed), max(0.0, wake - now) + 1e-3
                )
            except asyncio.TimeoutError:
                pass
            now = time.monotonic()
            if not closed.done() and now >= deadline:
                expected = self._expected()
                if self._closed is closed:
                    self._arrived.pop(member, None)
                raise _wire.Rejected(
                    "DEADLINE_EXCEEDED",
                    f"rendezvous of job {self.job_id!r} after generation "
                    f"{self.generation} did not close in time: "
                    f"{self.waiting + 1} worker(s) arrived, "
                    + (
                        f"{expected} expected"
                        if expected
                        else "waiting for a member of the running "
                        "generation to let them in"
                    )
                    + ".",
                )
        return closed.result()
