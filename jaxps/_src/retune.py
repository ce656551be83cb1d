"""``partition_bytes="auto"`` while a job runs: measure again when the rate
the calls achieve moves.

`tuning` measures the links once, right after init. The rate can change
later (another job starts sharing a link, or the first measurement was
taken on a busy machine), so the ranks keep timing their own calls:

- **The rate of a call.** A call of at least `MIN_CHUNKS` partitions is
  timed from `push_pull_async` to its last sum: its bytes over its seconds,
  the rate of the rank's share of the busiest link as `tuning` defines it
  (its fixed costs and its waits for the other ranks count against it).
- **Epochs.** The calls of a name are counted in epochs of
  `Config.retune_calls` rounds of its call check, the same count on every
  rank. Halfway through an epoch (on the first name that gets there) each
  rank pushes the median rate of the calls it timed since the last time,
  in a push_pull of its own, and gets every rank's back.
- **The decision**, the same on every rank since it depends on the sums
  alone. The largest rate of any rank (the one that came last timed its
  transfer alone) is compared with the reference, the rate of the first
  window after the last measurement. Where it moved more than `CHANGE`
  times up or down, the ranks measure again (`tuning.measure`) when the
  first call gets to the next epoch. Otherwise the partition stays.
- **The switch.** Every call of round r of its name plans with the
  partition of epoch ``r // retune_calls``. A call that gets to an epoch
  first takes its decision, waiting for the rates (which every rank pushed
  before its later rounds, so they are in by then) and for the
  measurement; the calls of other names that get there wait for it. A
  partition other than the one chosen at init gets wire names of its own
  (``name@<partition>B``), so its chunks have server keys of their own: a
  key's length is fixed at its first push.

Measuring again, rather than scaling the partition by the rate, keeps a
slow window that had another cause (a busy CPU, a straggler) from driving
the partition down: too small a partition makes the calls slower still
(up to 1.7x, `tuning.TIE`), and the next window would then ask for a
smaller one again. A measurement finds the partition from the candidates'
times, whatever slowed the window.

`jaxps.join` starts the count again, with the partition chosen at init on
every rank (a rank that joined early took none of the later decisions).
A name first pushed late in a job goes through the decisions from the
first epoch on, as every rank does for it.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable

import numpy as np

from jaxps._src import errors

#: A call of at least this many partitions is timed.
MIN_CHUNKS = 4
#: The rate must move more than this factor from the reference to measure
#: again (on this 2-core machine, windows of one setting spread by 10-20%).
CHANGE = 2.0
#: Most timed calls kept per window (the newest).
WINDOW = 256
#: Name of the push_pull of the rates (no user's name starts with a NUL).
RATES_NAME = "\0tune:rates"


class Retuner:
    """The partition of each call of a job with ``partition_bytes="auto"``.

    Args:
      partition: the partition chosen at init (epoch 0's).
      every: `Config.retune_calls`, the rounds of an epoch (>= 2).
      rank: this rank.
      size: the number of ranks.
      agree: ``agree(name, rates)`` starts a push_pull of the array `rates`
        summed over the ranks (not averaged) and returns its `Handle`.
      measure: ``measure()`` measures again with every rank
        (`tuning.measure`) and returns the partition chosen.
      deadline: seconds a decision may take, measuring included.
    """

    def __init__(
        self,
        partition: int,
        every: int,
        rank: int,
        size: int,
        agree: Callable,
        measure: Callable[[], int],
        deadline: float,
    ):
        if every < 2:
            raise ValueError(f"an epoch needs 2 calls or more, got {every}.")
        self.base = partition
        self.every = every
        self._rank, self._size = rank, size
        self._agree, self._measure = agree, measure
        self._deadline = deadline
        self._cond = threading.Condition()
        self._generation = 0  # resets so far (a decision of an older drops)
        #: times measured again since init (read by tests, benchmarks)
        self.measured = 0
        self.reset()

    def reset(self) -> None:
        """Epoch 0 again, with the partition chosen at init (`jaxps.join`)."""
        with self._cond:
            #: (first epoch, partition), in order of epochs
            self._changes: list[tuple[int, int]] = [(0, self.base)]
            self._decided = 0  # epochs decided: 0.._decided
            self._deciding: int | None = None
            self._launched = 0  # the rates of epochs 1.._launched are out
            self._agreed: dict[int, object] = {}  # epoch -> Handle
            self._timed: list[float] = []
            self._reference: float | None = None
            self._error: BaseException | None = None
            self._generation += 1
            self._cond.notify_all()

    @property
    def latest(self) -> int:
        """The partition of the latest epoch decided."""
        with self._cond:
            return self._changes[-1][1]

    def ended(self, rate: float) -> None:
        """A timed call moved its bytes at `rate` bytes/s."""
        with self._cond:
            self._timed.append(rate)
            del self._timed[:-WINDOW]

    def partition(self, number: int) -> int:
        """The partition of round `number` of a call's check; starts the
        next epoch's rates halfway through an epoch, and takes the decision
        of an epoch not decided yet (waiting at most the deadline)."""
        epoch, at = divmod(number, self.every)
        with self._cond:
            self._raise()
            launch = at >= self.every // 2 and self._launched <= epoch
            if launch:
                self._launched = epoch + 1
                mine = np.zeros((self._size, 2), np.float64)
                mine[self._rank] = (1.0, self._median())
                self._timed.clear()
                generation = self._generation
        if launch:
            handle = self._agree(RATES_NAME, mine.ravel())
            with self._cond:
                if generation == self._generation:
                    self._agreed[epoch + 1] = handle
                    self._cond.notify_all()
        return self._of(epoch)

    def _median(self) -> float:
        return float(np.median(self._timed)) if self._timed else 0.0

    def _raise(self) -> None:
        if self._error is not None:
            raise errors.JaxpsError(
                "partition_bytes='auto': deciding the partition again with "
                f"the other ranks failed earlier: {self._error}"
            ) from self._error

    def _of(self, epoch: int) -> int:
        """The partition of `epoch`, deciding the epochs up to it."""
        began = time.monotonic()
        while True:
            with self._cond:
                self._raise()
                if epoch <= self._decided:
                    starts = [e for e, _ in self._changes]
                    return self._changes[bisect.bisect(starts, epoch) - 1][1]
                left = self._deadline - (time.monotonic() - began)
                if left <= 0:
                    raise errors.RoundTimeoutError(
                        f"partition_bytes='auto': the partition of epoch "
                        f"{self._decided + 1} (epochs of {self.every} calls "
                        f"of a name) was not decided within "
                        f"{self._deadline:g} s on rank {self._rank}."
                    )
                nxt = self._decided + 1
                handle = self._agreed.get(nxt)
                if self._deciding is not None or handle is None:
                    # another call decides, or its rates are being pushed
                    self._cond.wait(min(left, 1.0))
                    continue
                self._deciding = nxt
                generation = self._generation
            try:
                partition = self._decide(nxt, handle, left)
            except BaseException as err:
                with self._cond:
                    if generation == self._generation:
                        self._error = err
                        self._deciding = None
                    self._cond.notify_all()
                raise
            with self._cond:
                if generation == self._generation:
                    del self._agreed[nxt]  # its sums are read
                    if partition != self._changes[-1][1]:
                        self._changes.append((nxt, partition))
                    self._decided = nxt
                    self._deciding = None
                self._cond.notify_all()

    def _decide(self, epoch: int, handle, left: float) -> int:
        """Epoch `epoch`'s partition from the rates of every rank."""
        try:
            rates = handle.wait(left)[0].reshape(self._size, 2)
        except errors.JaxpsError as err:
            raise _explained(
                err,
                f"partition_bytes='auto': the rates of epoch {epoch} did "
                "not come back from every rank",
            ) from err
        with self._cond:
            current = self._changes[-1][1]
            again = self._moved(rates)
        if not again:
            return current
        try:
            partition = self._measure()
        except errors.JaxpsError as err:
            raise _explained(
                err,
                "partition_bytes='auto': measuring the links again with "
                f"the other ranks, at epoch {epoch} (the rate moved), "
                "failed",
            ) from err
        with self._cond:
            self.measured += 1
            self._reference = None
        return partition

    def _moved(self, rates: np.ndarray) -> bool:
        """Whether the rates of every rank (``[present, rate]`` per rank)
        moved more than `CHANGE` from the reference (which the first
        window after a measurement sets)."""
        if not rates[:, 0].all():  # a rank pushed nothing: it has joined
            return False
        rate = float(rates[:, 1].max())
        if rate <= 0:  # no rank timed a call
            return False
        if self._reference is None:
            self._reference = rate
            return False
        return max(rate / self._reference, self._reference / rate) > CHANGE


def _explained(err: errors.JaxpsError, what: str) -> errors.JaxpsError:
    """`err` of the same type, its message after `what`."""
    text = f"{what}: {err}"
    try:
        return type(err)(text)
    except Exception:  # noqa: BLE001 - an error of other arguments
        return errors.JaxpsError(text)
