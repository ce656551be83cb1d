"""Per-key, per-round summation state of a server, free of gRPC.

The store's bookkeeping (`begin_push`, `pull`, `expire`) runs on one thread,
the server's event loop. The numpy work of a push (`PushTicket.run`) runs on
the engine thread that owns the key, so the pushes of a key are summed one at a
time without locks while different keys are summed in parallel.

Sums go into accumulators that each key reuses round after round (memory
that was already touched is several times faster to write than fresh
memory). No push is copied: the first is kept as it came, and the second is
added to it straight into the accumulator.

A push may also *lend* its payload (a worker's shared-memory slot, which the
worker leaves alone until its pull of the round returns). The running sum
is then made in place in a lent slot, and the finished sum is copied into
the other lent slots, where their ranks' pulls find it: a 2-rank round of
shared-memory pushes is one in-place add and one copy.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from . import _wire

try:  # optional: built from _sum.c where a C compiler was found
    from . import _sum
except ImportError:
    _sum = None

#: Dtypes `_sum.add` sums with streaming stores, by its kind code.
_STREAMED = {
    np.dtype(np.float32): "f4",
    np.dtype(np.float64): "f8",
    np.dtype(np.int32): "i4",
    np.dtype(np.int64): "i8",
}

# Half-precision payloads are accumulated in float32 and cast back once.
_ACCUMULATOR = {
    np.dtype(np.float16): np.dtype(np.float32),
}


#: The store refuses requests with `_wire.Rejected`.
StoreError = _wire.Rejected


def _accumulator_dtype(dtype: np.dtype) -> np.dtype:
    if dtype.kind == "V" or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return _ACCUMULATOR.get(dtype, dtype)


@dataclasses.dataclass(eq=False)
class Round:
    """One (key, round): contributions, the finished sum and who pulled it."""

    number: int
    started: float
    acc: np.ndarray  # the sum when no lent slot can hold it (acc. dtype)
    pushed: dict[int, int] = dataclasses.field(default_factory=dict)
    # pushes kept until they are added (the first one, or all of them in
    # rank order when deterministic)
    parts: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    # each lending rank's slot, where its pull finds the sum
    lent: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    running: np.ndarray | None = None  # the sum so far (acc or a lent slot)
    summed: int = 0
    total: np.ndarray | None = None  # the finished sum, in the wire dtype
    encoded: bytes | None = None  # `total` encoded once for every puller
    pulled: set[int] = dataclasses.field(default_factory=set)
    error: StoreError | None = None
    waiters: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Key:
    """A chunk key: its fixed dtype and length, and its live rounds."""

    key: int
    name: str
    dtype_code: int
    length: int
    engine: int
    done: int = -1  # rounds <= done are finished and freed
    # round `done`, kept until the next round is freed, so that a pull whose
    # reply was lost can be retried after the round was freed
    last: Round | None = None
    rounds: dict[int, Round] = dataclasses.field(default_factory=dict)
    # accumulators reused by rounds: slot -> (array, round using it)
    buffers: dict[int, tuple[np.ndarray, int]] = dataclasses.field(
        default_factory=dict
    )
    # async mode: the held value and each rank's last pushed round
    value: np.ndarray | None = None
    last_round: dict[int, int] = dataclasses.field(default_factory=dict)


class PushTicket:
    """The numpy work of one accepted push, run on the key's engine thread."""

    __slots__ = (
        "key",
        "round",
        "rank",
        "data",
        "num_workers",
        "ordered",
        "lent",
    )

    def __init__(self, key, rnd, rank, data, num_workers, ordered, lent):
        self.key = key
        self.round = rnd
        self.rank = rank
        self.data = data
        self.num_workers = num_workers
        self.ordered = ordered
        self.lent = lent

    @property
    def engine(self) -> int:
        return self.key.engine

    def run(self) -> bool:
        """Adds the payload into the round; returns True if it completed."""
        rnd, data = self.round, self.data
        if self.lent:
            rnd.lent[self.rank] = data
        running = rnd.running
        delivered = False
        if self.ordered:
            rnd.parts[self.rank] = data
        elif running is not None:
            last = rnd.summed + 1 == self.num_workers
            if last and running.dtype == data.dtype and len(rnd.lent) > 1:
                slots = [s for s in rnd.lent.values() if s is not running]
                _add_and_copy(running, data, slots)
                delivered = True
            else:
                np.add(running, data, out=running, casting="unsafe")
        elif not rnd.parts:
            if self.lent and data.dtype == rnd.acc.dtype:
                rnd.running = data  # the sum is made in this slot
            else:
                rnd.parts[self.rank] = data  # the next push adds to it
        else:
            ((first_rank, first),) = rnd.parts.items()
            rnd.parts = {}
            rnd.running = _sum_into(
                rnd, [first, data], [first_rank in rnd.lent, self.lent]
            )
        rnd.summed += 1
        if rnd.summed == self.num_workers:
            self._finish(rnd, data.dtype, delivered)
        return rnd.total is not None

    def _finish(self, rnd: Round, dtype: np.dtype, delivered: bool) -> None:
        """Makes the total and copies it into every lent slot (unless the
        last add `delivered` it there already)."""
        if rnd.parts:  # deterministic, or a single rank
            ranks = sorted(rnd.parts)
            parts = [rnd.parts[r] for r in ranks]
            rnd.parts = {}
            rnd.running = _sum_into(rnd, parts, [r in rnd.lent for r in ranks])
        total = _cast(rnd.running, dtype)
        for slot in () if delivered else rnd.lent.values():
            if slot is not total:
                np.copyto(slot, total)
        if len(rnd.lent) < self.num_workers and any(
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
        _add_into(parts[0], parts[1], acc)
    else:  # in place in a lent slot
        np.add(parts[0], parts[1], out=out, dtype=out.dtype, casting="unsafe")
    for part in parts[2:]:
        np.add(out, part, out=out, casting="unsafe")
    return out


def _add_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a + b`` into a third array (an accumulator, most likely not
    in the cache), with streaming stores where `_sum` is built: ordinary
    stores would first read every line of `out`."""
    kind = _STREAMED.get(out.dtype)
    if (
        _sum is not None
        and _sum.NONTEMPORAL
        and kind is not None
        and a.dtype == b.dtype == out.dtype
    ):
        _sum.add(kind, a, b, out)
    else:
        np.add(a, b, out=out, dtype=out.dtype, casting="unsafe")


#: Block of `_add_and_copy`: the copies read it from the core's cache.
_BLOCK_BYTES = 256 * 1024


def _add_and_copy(running: np.ndarray, data: np.ndarray, copies) -> None:
    """``running += data``, then `running` into each of `copies`, a block at
    a time, so the copies read the sum from the cache, not from memory."""
    step = max(1, _BLOCK_BYTES // running.itemsize)
    for lo in range(0, running.size, step):
        block = running[lo : lo + step]
        np.add(block, data[lo : lo + step], out=block, casting="unsafe")
        for copy in copies:
            np.copyto(copy[lo : lo + step], block)


def _cast(acc: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return acc if acc.dtype == dtype else acc.astype(dtype)


def _tobytes(array: np.ndarray) -> bytes:
    return array.tobytes()


class Store:
    """Sums the contributions of `num_workers` ranks for each (key, round).

    Args:
      num_workers: number of ranks that contribute to every round.
      round_timeout: seconds a round may stay incomplete after its first push
        before it fails for every rank, naming the missing ones.
      engine_threads: number of engine threads keys are spread over.
      deterministic: sum contributions in rank order, so the result is bitwise
        the same whatever the arrival order.
      round_window: how many rounds of one key may be live at once.
      encode: turns a finished sum (an array) into the bytes every puller
        receives; the default is the raw array bytes.
    """

    def __init__(
        self,
        num_workers: int,
        *,
        round_timeout: float = 60.0,
        engine_threads: int = 1,
        deterministic: bool = False,
        round_window: int = 2,
        encode=_tobytes,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}.")
        self.num_workers = num_workers
        self.round_timeout = round_timeout
        self.deterministic = deterministic
        self.round_window = round_window
        self.encode = encode
        self._keys: dict[int, Key] = {}
        self._engine_bytes = [0] * max(1, engine_threads)
        self.rounds_completed = 0
        self.bytes_summed = 0
        self.last_round_by_rank: dict[int, int] = {}

    # -- pushes ------------------------------------------------------------

    def begin_push(
        self,
        *,
        key: int,
        round: int,
        rank: int,
        dtype_code: int,
        length: int,
        payload: bytes,
        checksum: int,
        name: str = "",
        now: float | None = None,
        lent: bool = False,
    ) -> PushTicket | None:
        """Validates a push; returns its work, or None for a repeat.

        A push whose dtype or length contradicts the key's first push fails
        the round for every rank, so nobody waits for a sum that cannot be.
        Payloads are kept (not copied) until they are added. A `lent`
        payload is a writable buffer that the store may use until `rank`
        pulls the round: the sum is made or left in it, and that pull must
        name the same buffer.
        """
        k, dtype = self._validate_push(
            key, round, rank, dtype_code, length, payload, name
        )
        if k.last is not None and k.last.number == round:
            rnd = k.last  # a PushPull retried after its round was freed
        else:
            rnd = self._round(k, round, now)
        previous = rnd.pushed.get(rank)
        if previous is not None:
            if previous != checksum:
                raise StoreError(
                    "ABORTED",
                    f"rank {rank} pushed key {self._label(k)} round {round} "
                    "twice with different payloads (checksum "
                    f"{previous:#010x} then {checksum:#010x}); the first was "
                    "kept.",
                )
            return None  # an identical retry: acknowledged, not summed again
        rnd.pushed[rank] = checksum
        if round > self.last_round_by_rank.get(rank, -1):
            self.last_round_by_rank[rank] = round
        data = np.frombuffer(payload, dtype=dtype)
        self.bytes_summed += len(payload)
        return PushTicket(
            k,
            rnd,
            rank,
            data,
            self.num_workers,
            self.deterministic,
            lent,
        )

    def _validate_push(
        self, key, round, rank, dtype_code, length, payload, name
    ) -> tuple[Key, np.dtype]:
        """Checks rank, dtype and size; returns the key (created if new)."""
        self.check_rank(rank)
        dtype = self._dtype(key, dtype_code)
        label = f"{key} ({name})" if name else str(key)
        if length < 1 or len(payload) != length * dtype.itemsize:
            raise StoreError(
                "INVALID_ARGUMENT",
                f"payload of key {label} has {len(payload)} bytes but "
                f"length={length} elements of {dtype} need "
                f"{max(length, 1) * dtype.itemsize} bytes.",
            )
        try:
            return self._key(key, dtype_code, length, name), dtype
        except StoreError as err:
            self._poison(key, round, err)
            raise

    def finish_push(self, ticket: PushTicket) -> None:
        """Wakes the pulls of a round that `ticket.run()` completed."""
        rnd = ticket.round
        if rnd.total is not None:
            self.rounds_completed += 1
            self._wake(rnd)

    def fail_push(self, ticket: PushTicket, err: BaseException) -> None:
        """Fails the round of a ticket whose `run` raised `err`."""
        if not isinstance(err, StoreError):
            err = StoreError(
                "INTERNAL",
                f"summing the push of rank {ticket.rank} failed: {err!r}",
            )
        self._poison(ticket.key.key, ticket.round.number, err)

    # -- pulls -------------------------------------------------------------

    def pull(
        self,
        *,
        key: int,
        round: int,
        rank: int,
        dtype_code: int,
        length: int,
        now: float | None = None,
        raw: bool = False,
        into=None,
    ) -> tuple[Round, bytes | np.ndarray | None]:
        """Returns the round and its sum, or None if it is not complete.

        The sum is the encoded reply; with `raw` the array itself (valid
        until the key's round after next is summed, or for a rank that lent
        its push, until that rank reuses its slot); with `into` (a writable
        buffer) it is put there and `into` is returned. A rank that lent
        its push must pull into the same buffer, where the sum already is.
        """
        self.check_rank(rank)
        k = self._keys.get(key)
        if k is None:
            raise StoreError(
                "FAILED_PRECONDITION",
                f"pull of unknown key {key} round {round}: this server has "
                "never seen a push of it (was it restarted?).",
            )
        self._check_schema(k, dtype_code, length)
        if k.last is not None and k.last.number == round:
            # a retried pull of the round just freed
            return k.last, self._answer(k, k.last, rank, raw, into)
        rnd = self._round(k, round, now)
        if rnd.error is not None:
            raise rnd.error
        if rnd.total is None:
            return rnd, None
        return rnd, self._take(k, rnd, rank, raw, into)

    def collect(
        self, key: int, rnd: Round, rank: int, raw: bool = False, into=None
    ) -> bytes | np.ndarray:
        """Returns the sum of a round that completed while `rank` waited."""
        if rnd.error is not None:
            raise rnd.error
        k = self._keys[key]
        if rnd.total is None:
            missing = sorted(set(range(self.num_workers)) - set(rnd.pushed))
            raise StoreError(
                "DEADLINE_EXCEEDED",
                f"pull of round {rnd.number} of key {self._label(k)} by rank "
                f"{rank} hit its deadline while waiting for rank(s) "
                f"{missing} to push.",
            )
        return self._take(k, rnd, rank, raw, into)

    def _answer(self, k: Key, rnd: Round, rank: int, raw: bool, into):
        # A lending rank's own slot holds the sum; the total may be another
        # rank's slot, which its owner reuses once it has pulled.
        own = rnd.lent.get(rank)
        if into is not None:
            out = np.frombuffer(into, rnd.total.dtype, rnd.total.size)
            if own is None:
                np.copyto(out, rnd.total)
            elif own.ctypes.data != out.ctypes.data:  # not the same slot
                raise StoreError(
                    "INVALID_ARGUMENT",
                    f"rank {rank} pushed round {rnd.number} of key "
                    f"{self._label(k)} from a shared-memory slot and must "
                    "pull it into the same slot.",
                )
            return into
        if own is not None:
            return own if raw else self.encode(own)
        if raw:
            return rnd.total
        if rnd.encoded is None:
            rnd.encoded = self.encode(rnd.total)
        return rnd.encoded

    def _take(self, k: Key, rnd: Round, rank: int, raw: bool, into):
        answer = self._answer(k, rnd, rank, raw, into)
        rnd.pulled.add(rank)
        if len(rnd.pulled) == self.num_workers:
            del k.rounds[rnd.number]
            if rnd.number > k.done:
                k.done, k.last = rnd.number, rnd
        return answer

    def deadline(self, rnd: Round) -> float:
        """Monotonic time at which `rnd` fails if still incomplete."""
        return rnd.started + self.round_timeout

    def fail_if_late(self, key: int, rnd: Round, now: float) -> None:
        """Fails `rnd` if it is incomplete past its deadline."""
        if (
            rnd.total is None
            and rnd.error is None
            and now >= self.deadline(rnd)
        ):
            self._fail(self._keys[key], rnd)

    def expire(self, now: float | None = None) -> int:
        """Fails incomplete rounds past their deadline; returns how many."""
        now = time.monotonic() if now is None else now
        failed = 0
        for k in self._keys.values():
            for rnd in list(k.rounds.values()):
                if rnd.error is not None:
                    if now >= self.deadline(rnd) + self.round_timeout:
                        del k.rounds[rnd.number]  # forget it after a while
                    continue
                if rnd.total is None and now >= self.deadline(rnd):
                    self._fail(k, rnd)
                    failed += 1
        return failed

    def _poison(self, key: int, number: int, err: StoreError) -> None:
        k = self._keys.get(key)
        rnd = None if k is None else k.rounds.get(number)
        if rnd is not None and rnd.total is None and rnd.error is None:
            rnd.error = StoreError(
                err.code, f"round {number} failed: {err.message}"
            )
            rnd.parts = {}
            self._wake(rnd)

    def _fail(self, k: Key, rnd: Round) -> None:
        missing = sorted(set(range(self.num_workers)) - set(rnd.pushed))
        rnd.error = StoreError(
            "DEADLINE_EXCEEDED",
            f"round {rnd.number} of key {self._label(k)} timed out after "
            f"{self.round_timeout:g} s waiting for rank(s) {missing} to push "
            f"(ranks {sorted(rnd.pushed)} did).",
        )
        rnd.parts = {}
        k.done = max(k.done, rnd.number)
        self._wake(rnd)

    # -- helpers -----------------------------------------------------------

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_workers:
            raise StoreError(
                "INVALID_ARGUMENT",
                f"rank {rank} out of range: this server sums "
                f"num_workers={self.num_workers} ranks [0, "
                f"{self.num_workers}).",
            )

    @staticmethod
    def _dtype(key: int, dtype_code: int) -> np.dtype:
        try:
            return _wire.code_dtype(dtype_code)
        except KeyError:
            raise StoreError(
                "INVALID_ARGUMENT",
                f"dtype of key {key} is {_wire.dtype_name(dtype_code)}; "
                f"supported: {', '.join(_wire.SUPPORTED_DTYPES)}.",
            ) from None

    def _key(self, key: int, dtype_code: int, length: int, name: str) -> Key:
        """The key's state, created by its first (validated) push."""
        k = self._keys.get(key)
        if k is None:
            engine = min(
                range(len(self._engine_bytes)),
                key=self._engine_bytes.__getitem__,
            )
            itemsize = _wire.code_dtype(dtype_code).itemsize
            self._engine_bytes[engine] += length * itemsize
            k = Key(key, name, dtype_code, length, engine)
            self._keys[key] = k
            return k
        self._check_schema(k, dtype_code, length)
        return k

    def _check_schema(self, k: Key, dtype_code: int, length: int) -> None:
        if dtype_code != k.dtype_code:
            raise StoreError(
                "INVALID_ARGUMENT",
                f"dtype of key {self._label(k)} is "
                f"{_wire.dtype_name(dtype_code)} but its first push had "
                f"{_wire.dtype_name(k.dtype_code)}.",
            )
        if length != k.length:
            raise StoreError(
                "INVALID_ARGUMENT",
                f"length of key {self._label(k)} is {length} but its first "
                f"push had length={k.length}.",
            )

    def _round(self, k: Key, number: int, now: float | None) -> Round:
        rnd = k.rounds.get(number)
        if rnd is not None:
            return rnd
        if number <= k.done:
            raise StoreError(
                "ABORTED",
                f"round {number} of key {self._label(k)} is from the past: "
                f"rounds up to {k.done} are finished.",
            )
        if number > k.done + self.round_window:
            raise StoreError(
                "FAILED_PRECONDITION",
                f"round {number} of key {self._label(k)} is too far ahead: "
                f"rounds up to {k.done} are finished and at most "
                f"{self.round_window} may be live.",
            )
        now = time.monotonic() if now is None else now
        rnd = Round(number, now, self._accumulator(k, number))
        k.rounds[number] = rnd
        return rnd

    def _accumulator(self, k: Key, number: int) -> np.ndarray:
        """A reused accumulator for round `number` of `k`.

        Round n takes slot n % (round_window + 1), unless the round that
        last used the slot is still live or kept for retried pulls (after a
        failed round, older rounds may still wait for their last pull).
        """
        slot = number % (self.round_window + 1)
        held = k.buffers.get(slot)
        if held is not None:
            array, owner = held
            if owner not in k.rounds and (
                k.last is None or k.last.number != owner
            ):
                k.buffers[slot] = (array, number)
                return array
        dtype = _accumulator_dtype(_wire.code_dtype(k.dtype_code))
        array = np.empty(k.length, dtype)
        if held is None:
            k.buffers[slot] = (array, number)
        return array

    @staticmethod
    def _wake(rnd: Round) -> None:
        waiters, rnd.waiters = rnd.waiters, []
        for wake in waiters:
            wake()

    @staticmethod
    def _label(k: Key) -> str:
        return f"{k.key} ({k.name})" if k.name else str(k.key)

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    def pending_pulls(self) -> int:
        """Number of pulls waiting for their round to complete."""
        return sum(
            len(rnd.waiters)
            for k in self._keys.values()
            for rnd in k.rounds.values()
        )

    def pending_rounds(self) -> int:
        """Number of rounds that are live (incomplete or not fully pulled)."""
        return sum(len(k.rounds) for k in self._keys.values())
