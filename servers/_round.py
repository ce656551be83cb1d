"""One (key, round) of a server and the summation of its pushes.

No push is copied: the first is kept as it came, and the second is added to
it straight into the round's accumulator. A push may also *lend* its
payload (a worker's shared-memory slot, which the worker leaves alone until
its pull of the round returns). The running sum is then made in place in a
lent slot, and the finished sum is copied into the other lent slots, where
their ranks' pulls find it: a 2-rank round of shared-memory pushes is one
in-place add and one copy.

A round is complete once `Round.quorum` pushes are summed: every rank's,
or fewer while some ranks have joined (`jaxps.join`; see
`Round.lower_quorum`).

Threading rule: a round's *sum state* (`Round.parts`, `lent`, `running`,
`summed`, `quorum`, `total`) changes only under `Round.lock`.
`PushTicket.run` holds it on the thread that sums (the key's engine
thread, or the event loop), and `Round.fail` and `Round.lower_quorum`, the
event loop's only ways to touch the sum state, take it too. Everything
else in a round belongs to the event loop. `total` is set last and once,
and after it the sum state never changes (`run` asserts so), so the event
loop reads `total`, `lent` and `summed` without the lock.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from . import _kernels, _wire


@dataclasses.dataclass(eq=False)
class Round:
    """One (key, round): contributions, the finished sum and who pulled it.

    The sum state is guarded by `lock` (see the module's threading rule).
    """

    number: int
    started: float
    deadline: float  # monotonic time at which it fails if incomplete
    acc: np.ndarray  # the sum when no lent slot can hold it (acc. dtype)
    # -- sum state, under `lock` ---------------------------------------------
    quorum: int = 1  # pushes that complete the round (its contributors)
    # pushes kept until they are added (the first one, or all of them in
    # rank order when deterministic)
    parts: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    # each lending rank's slot, where its pull finds the sum
    lent: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    running: np.ndarray | None = None  # the sum so far (acc or a lent slot)
    summed: int = 0
    total: np.ndarray | None = None  # the finished sum, in the wire dtype
    # -- event loop state ------------------------------------------------------
    pushed: dict[int, int] = dataclasses.field(default_factory=dict)
    # the call checks its pushes carried (`_store._Signed`): its sum is
    # answered only once each is agreed on by every rank, or fails with it
    signs: list = dataclasses.field(default_factory=list)
    encoded: bytes | None = None  # `total` encoded once for every puller
    pulled: set[int] = dataclasses.field(default_factory=set)
    error: _wire.Rejected | None = None
    waiters: list = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def fail(self, error: _wire.Rejected) -> bool:
        """Fails the round with `error` unless it is complete or failed
        already; returns whether it did. Drops the kept pushes."""
        with self.lock:
            if self.total is not None or self.error is not None:
                return False
            self.error = error
            self.parts = {}
            return True

    def lower_quorum(self, quorum: int, dtype: np.dtype) -> bool:
        """Completes the round with `quorum` contributions (`dtype`: the
        wire dtype) if that many are summed already, else lets the next
        push that reaches `quorum` complete it; returns whether it
        completed now. A finished, failed or empty round is left alone."""
        with self.lock:
            if self.total is not None or self.error is not None:
                return False
            self.quorum = quorum
            if self.summed == 0 or self.summed < quorum:
                return False
            _finish(self, dtype, delivered=False)
            return True


class PushTicket:
    """The numpy work of one accepted push, run on the key's engine thread
    (or on the event loop): `run` adds its payload into the round."""

    __slots__ = (
        "key",
        "round",
        "rank",
        "data",
        "ordered",
        "lent",
    )

    def __init__(self, key, rnd, rank, data, ordered, lent):
        self.key = key
        self.round = rnd
        self.rank = rank
        self.data = data
        self.ordered = ordered
        self.lent = lent

    @property
    def engine(self) -> int:
        return self.key.engine

    def run(self) -> bool:
        """Adds the payload into the round; returns True if it completed."""
        rnd = self.round
        with rnd.lock:
            if rnd.total is not None:
                raise AssertionError(
                    f"push of rank {self.rank} into round {rnd.number}, "
                    "whose sum is finished."
                )
            if self.lent:
                rnd.lent[self.rank] = self.data
            delivered = self._add()
            rnd.summed += 1
            if rnd.summed == rnd.quorum:
                _finish(rnd, self.data.dtype, delivered)
            return rnd.total is not None

    def _add(self) -> bool:
        """Adds the payload by the first rule that applies; returns True if
        the sum is in every lent slot already."""
        if self.ordered:
            return self._keep()
        if self.round.running is not None:
            return self._add_to_running()
        if self.round.parts:
            return self._add_to_kept()
        return self._start()

    def _keep(self) -> bool:
        """Deterministic: every push waits, to be summed in rank order."""
        self.round.parts[self.rank] = self.data
        return False

    def _start(self) -> bool:
        """The first push: a lent slot of the accumulator's dtype holds the
        sum from now on; any other push waits for the second."""
        rnd = self.round
        if self.lent and self.data.dtype == rnd.acc.dtype:
            rnd.running = self.data
        else:
            rnd.parts[self.rank] = self.data
        return False

    def _add_to_kept(self) -> bool:
        """The second push: adds it to the kept first one, into a lent slot
        of the two or else the accumulator."""
        rnd = self.round
        ((first_rank, first),) = rnd.parts.items()
        rnd.parts = {}
        rnd.running = _sum_into(
            rnd, [first, self.data], [first_rank in rnd.lent, self.lent]
        )
        return False

    def _add_to_running(self) -> bool:
        """A later push: adds it to the running sum; the round's last add
        copies the sum into the other lent slots block by block."""
        rnd, data, running = self.round, self.data, self.round.running
        last = rnd.summed + 1 == rnd.quorum
        if last and running.dtype == data.dtype and len(rnd.lent) > 1:
            slots = [s for s in rnd.lent.values() if s is not running]
            _kernels.add_and_copy(running, data, slots)
            return True
        np.add(running, data, out=running, casting="unsafe")
        return False


def _finish(rnd: Round, dtype: np.dtype, delivered: bool) -> None:
    """Makes the total of `rnd` (in the wire `dtype`, under its lock) and
    copies it into every lent slot (unless the last add `delivered` it
    there already)."""
    if rnd.parts:  # deterministic, or a single contribution
        ranks = sorted(rnd.parts)
        parts = [rnd.parts[r] for r in ranks]
        rnd.parts = {}
        rnd.running = _sum_into(rnd, parts, [r in rnd.lent for r in ranks])
    total = _kernels.cast(rnd.running, dtype)
    for slot in () if delivered else rnd.lent.values():
        if slot is not total:
            np.copyto(slot, total)
    if len(rnd.lent) < rnd.summed and any(
        slot is total for slot in rnd.lent.values()
    ):
        # gRPC pullers need the sum after the slot's owner reuses it
        np.copyto(rnd.acc, total)
        total = rnd.acc
    rnd.total = total


def _sum_into(rnd: Round, parts: list, lent: list[bool]) -> np.ndarray:
    """Sums `parts` in order into a lent slot among the first two, else into
    the accumulator; returns where the sum is."""
    acc = rnd.acc
    out = next(
        (p for p, ok in zip(parts[:2], lent) if ok and p.dtype == acc.dtype),
        acc,
    )
    if len(parts) == 1:
        if out is not parts[0]:
            np.copyto(out, parts[0], casting="unsafe")
        return out
    if out is acc:
        _kernels.add_into(parts[0], parts[1], acc)
    else:  # in place in a lent slot
        np.add(parts[0], parts[1], out=out, dtype=out.dtype, casting="unsafe")
    for part in parts[2:]:
        np.add(out, part, out=out, casting="unsafe")
    return out
