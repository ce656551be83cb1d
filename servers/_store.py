"""The key registry and the round store of a server, free of gRPC.

`Keys` fixes each chunk key's dtype, length and engine thread at its first
push and validates every request against them. `Store` keeps each key's
live rounds (`_round.Round`) within a window, hands out the numpy work of
each push (`_round.PushTicket`), answers pulls and fails rounds past their
deadline. Its bookkeeping runs on one thread, the server's event loop; the
tickets run on the key's engine thread (see `_round` for the threading
rule), so a key's pushes are summed one at a time while different keys are
summed in parallel.

Sums go into accumulators that each key reuses round after round (memory
that was already touched is several times faster to write than fresh
memory).

`PushPullStore` is the interface the summation core (`_summation`) uses;
`Store` and `_async_store.AsyncStore` implement it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Protocol, runtime_checkable

import numpy as np

from . import _kernels, _wire
from ._round import PushTicket, Round

log = logging.getLogger("jaxps.server")

#: The store refuses requests with `_wire.Rejected`.
StoreError = _wire.Rejected


class Ticket(Protocol):
    """The numpy work of one accepted push."""

    data: np.ndarray

    @property
    def engine(self) -> int:
        """The engine thread that runs it (its key's)."""

    def run(self) -> bool:
        """Adds the payload; returns True if it completed a round."""


@runtime_checkable
class PushPullStore(Protocol):
    """What the summation core needs of a store.

    A push is `begin_push`, then its ticket's `run` (on the ticket's engine
    thread or inline), then `finish_push` on the event loop. A pull is
    `pull`; if it returns a round but no answer, the caller waits for a
    wake-up (`Round.waiters`) or the round's `deadline`, then `collect`\\ s.
    """

    num_workers: int
    #: Whether a push is acknowledged only once summed (then a sum that
    #: raises fails the push); else it is acknowledged once accepted.
    acks_after_sum: bool
    bytes_summed: int
    rounds_completed: int
    last_round_by_rank: dict[int, int]

    def check_rank(self, rank: int) -> None: ...

    def begin_push(
        self,
        *,
        key: int,
        round: int,
        rank: int,
        dtype_code: int,
        length: int,
        payload,
        checksum: int,
        name: str = "",
        now: float | None = None,
        lent: bool = False,
        signature: int = 0,
        description: str = "",
        check_key: int = 0,
        check_round: int = 0,
        check_call: str = "",
    ) -> Ticket | None: ...

    def finish_push(
        self, ticket: Ticket, error: BaseException | None = None
    ) -> None: ...

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
    ) -> tuple[Round | None, Any]: ...

    def collect(
        self,
        key: int,
        rnd: Round,
        rank: int,
        raw: bool = False,
        into=None,
        now: float | None = None,
        until: float = 0.0,
    ) -> Any: ...

    def expire(self, now: float | None = None) -> int: ...

    def abort(
        self,
        *,
        key: int,
        round: int,
        rank: int,
        dtype_code: int,
        length: int,
        name: str,
        reason: str,
        now: float | None = None,
    ) -> None:
        """`rank` gives up round `round` of `key` (its call failed): the
        round fails at once for every rank, naming `rank` and `reason`."""

    def join(self, ranks: frozenset[int]) -> int:
        """The ranks in `ranks` have joined (`jaxps.join`): rounds complete
        without them; returns how many rounds that completed now."""

    def reset_rounds(self) -> None:
        """Every rank joined: keys start again at the round of their next
        push, and nobody is joined."""

    def close(self) -> None:
        """Frees every key (the store's session ended)."""

    @property
    def num_keys(self) -> int: ...

    def pending_pulls(self) -> int: ...

    def pending_rounds(self) -> int: ...


def check_rank(rank: int, num_workers: int) -> None:
    """Refuses a rank outside ``[0, num_workers)``."""
    if not 0 <= rank < num_workers:
        raise StoreError(
            "INVALID_ARGUMENT",
            f"rank {rank} out of range: this server sums "
            f"num_workers={num_workers} ranks [0, {num_workers}).",
        )


def _tobytes(array: np.ndarray, contributors: int = 0) -> bytes:
    del contributors
    return array.tobytes()


class Budget:
    """The bytes a server may hold in accumulators and encoded sums
    (``--max-memory``), shared by the stores of all its sessions.

    Args:
      max_bytes: the cap; None is no cap.
    """

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = max_bytes
        self.held = 0

    def reserve(self, nbytes: int, what: str) -> None:
        """Counts `nbytes` more, or raises RESOURCE_EXHAUSTED naming the
        cap and `what` needed them."""
        if self.max_bytes is not None and self.held + nbytes > self.max_bytes:
            mib = 1 << 20
            raise StoreError(
                "RESOURCE_EXHAUSTED",
                f"{what} needs {nbytes / mib:.1f} MiB but this server "
                f"already holds {self.held / mib:.1f} MiB of its "
                f"--max-memory {self.max_bytes / mib:.0f} MiB.",
            )
        self.held += nbytes

    def release(self, nbytes: int) -> None:
        self.held -= nbytes


@dataclasses.dataclass(eq=False)
class Key:
    """A chunk key: its fixed dtype, length and engine, and its live rounds
    (a `Store`'s)."""

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

    @property
    def label(self) -> str:
        """The key for messages: its number and, if known, its name."""
        return f"{self.key} ({self.name})" if self.name else str(self.key)


class Keys:
    """The keys a server knows, each fixed by its first valid push.

    Args:
      num_workers: number of ranks; valid ranks are ``[0, num_workers)``.
      engine_threads: engine threads keys are spread over (by bytes).
    """

    def __init__(self, num_workers: int, engine_threads: int = 1):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}.")
        self.num_workers = num_workers
        self._keys: dict[int, Key] = {}
        self._engine_bytes = [0] * max(1, engine_threads)

    def check_rank(self, rank: int) -> None:
        check_rank(rank, self.num_workers)

    def check_payload(
        self, key, rank, dtype_code, length, payload, name
    ) -> np.dtype:
        """Checks a push's rank, dtype and size; returns its dtype."""
        self.check_rank(rank)
        dtype = _dtype(key, dtype_code)
        label = f"{key} ({name})" if name else str(key)
        if length < 1 or len(payload) != length * dtype.itemsize:
            raise StoreError(
                "INVALID_ARGUMENT",
                f"payload of key {label} has {len(payload)} bytes but "
                f"length={length} elements of {dtype} need "
                f"{max(length, 1) * dtype.itemsize} bytes.",
            )
        return dtype

    def add(self, key: int, dtype_code: int, length: int, name: str) -> Key:
        """The key's state, created by its first (checked) push; raises if
        the push contradicts the key's dtype or length."""
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
        self.check_schema(k, dtype_code, length)
        return k

    def get(self, key: int) -> Key | None:
        return self._keys.get(key)

    @staticmethod
    def check_schema(k: Key, dtype_code: int, length: int) -> None:
        if dtype_code != k.dtype_code:
            raise StoreError(
                "INVALID_ARGUMENT",
                f"dtype of key {k.label} is "
                f"{_wire.dtype_name(dtype_code)} but its first push had "
                f"{_wire.dtype_name(k.dtype_code)}.",
            )
        if length != k.length:
            raise StoreError(
                "INVALID_ARGUMENT",
                f"length of key {k.label} is {length} but its first "
                f"push had length={k.length}.",
            )

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self):
        return iter(self._keys.values())


def _dtype(key: int, dtype_code: int) -> np.dtype:
    try:
        return _wire.code_dtype(dtype_code)
    except KeyError:
        raise StoreError(
            "INVALID_ARGUMENT",
            f"dtype of key {key} is {_wire.dtype_name(dtype_code)}; "
            f"supported: {', '.join(_wire.SUPPORTED_DTYPES)}.",
        ) from None


def _check_pending(rnd: Round) -> bool:
    """Whether a call check that `rnd` carried is neither agreed on nor
    failed yet."""
    return any(not s.agreed and s.error is None for s in rnd.signs)


def _carried_mismatch(
    call: str, number: int, rank: int, description: str, err: StoreError
) -> StoreError:
    """The error of a piece that carried a call check (of `rank`'s tree
    `description`) and that another rank's push of its key contradicts
    (`err`): their trees differ."""
    return StoreError(
        "INVALID_ARGUMENT",
        f"{_wire.MISMATCH_PREFIX}push_pull {call!r} (round {number}) "
        f"differs between ranks: rank {rank} pushed [{description}] and "
        f"another rank pushed a piece of it otherwise: {err.message}",
    )


@dataclasses.dataclass(eq=False)
class _Signed:
    """One round of a call check (`Store._sign`): its first signature,
    the rank and description that brought it, the ranks that agreed and
    the pieces (key, round) that carried a signature."""

    signature: int
    rank: int
    description: str
    call: str
    number: int
    started: float
    ranks: set[int] = dataclasses.field(default_factory=set)
    carriers: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    error: StoreError | None = None
    agreed: bool = False  # every rank signed the same


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
      encode: turns a finished sum (an array) and its number of
        contributors into the bytes every puller receives; the default is
        the raw array bytes.
      budget: the memory cap this store counts its accumulators and encoded
        sums against (shared by a server's stores).
    """

    #: Pushes are acknowledged once accepted, and summed in the background.
    acks_after_sum = False

    def __init__(
        self,
        num_workers: int,
        *,
        round_timeout: float = 60.0,
        engine_threads: int = 1,
        deterministic: bool = False,
        round_window: int = 2,
        encode=_tobytes,
        budget: Budget | None = None,
    ):
        self._keys = Keys(num_workers, engine_threads)
        self.budget = Budget() if budget is None else budget
        self.held = 0  # bytes of this store in `budget`
        self.num_workers = num_workers
        self.round_timeout = round_timeout
        self.deterministic = deterministic
        self.round_window = round_window
        self.encode = encode
        self.rounds_completed = 0
        self.bytes_summed = 0
        self.last_round_by_rank: dict[int, int] = {}
        #: ranks that have joined (`jaxps.join`): rounds complete without them
        self.joined: frozenset[int] = frozenset()
        # check key -> round -> what the call checks of that round signed
        self._signed: dict[int, dict[int, _Signed]] = {}

    def check_rank(self, rank: int) -> None:
        self._keys.check_rank(rank)

    def _missing(self, rnd: Round) -> list[int]:
        """The ranks a round still waits for (joined ranks push nothing)."""
        return sorted(
            set(range(self.num_workers)) - set(rnd.pushed) - self.joined
        )

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
        signature: int = 0,
        description: str = "",
        check_key: int = 0,
        check_round: int = 0,
        check_call: str = "",
    ) -> PushTicket | None:
        """Validates a push; returns its work, or None for a repeat.

        A push whose dtype or length contradicts the key's first push fails
        the round for every rank, so nobody waits for a sum that cannot be;
        so does a call check (a nonzero `signature`, with its
        `description`) that differs from the first of its round (see
        `_sign`). The check is a push of its own key, or rides on a piece
        of the call (a nonzero `check_key`, with `check_round` and the
        call's name `check_call`). A rank that has joined may not push.
        Payloads are kept (not copied) until they are added. A `lent`
        payload is a writable buffer that the store may use until `rank`
        pulls the round: the sum is made or left in it, and that pull must
        name the same buffer.
        """
        signed = None
        if check_key:  # first: a mismatch is named, not a length
            self.check_rank(rank)
            signed = self._sign(
                check_key,
                check_round,
                rank,
                signature,
                description,
                check_call,
                carrier=(key, round),
            )
        try:
            dtype = self._keys.check_payload(
                key, rank, dtype_code, length, payload, name
            )
        except StoreError as err:
            if signed is None or err.code != "INVALID_ARGUMENT":
                raise
            # another rank pushed this key otherwise: another tree
            raise _carried_mismatch(
                check_call, check_round, rank, description, err
            ) from None
        if rank in self.joined:
            raise StoreError(
                "FAILED_PRECONDITION",
                f"rank {rank} pushed key {key} ({name}) round {round} after "
                "it joined (jaxps.join): a joined rank pushes nothing until "
                "every rank has joined.",
            )
        try:
            k = self._keys.add(key, dtype_code, length, name)
        except StoreError as err:
            self._poison(key, round, err)
            if signed is None or err.code != "INVALID_ARGUMENT":
                raise
            raise _carried_mismatch(
                check_call, check_round, rank, description, err
            ) from None
        if k.done == -1 and not k.rounds and k.last is None:
            # A new key starts at the round of its first push (a key freed
            # after idling, or a worker that re-pushes to a new server).
            k.done = round - 1
        if k.last is not None and k.last.number == round:
            rnd = k.last  # a PushPull retried after its round was freed
        else:
            rnd = self._round(k, round, now, pusher=rank)
        previous = rnd.pushed.get(rank)
        if previous is not None:
            if previous != checksum:
                raise StoreError(
                    "ABORTED",
                    f"rank {rank} pushed key {k.label} round {round} "
                    "twice with different payloads (checksum "
                    f"{previous:#010x} then {checksum:#010x}); the first was "
                    "kept.",
                )
            return None  # an identical retry: acknowledged, not summed again
        if signature and not check_key:  # a check of its own
            self._sign(key, round, rank, signature, description, k.name)
        if signed is not None and not signed.agreed:
            rnd.signs.append(signed)  # its sum waits for the check
        rnd.pushed[rank] = checksum
        if round > self.last_round_by_rank.get(rank, -1):
            self.last_round_by_rank[rank] = round
        data = np.frombuffer(payload, dtype=dtype)
        self.bytes_summed += len(payload)
        return PushTicket(k, rnd, rank, data, self.deterministic, lent)

    def _sign(
        self,
        check_key: int,
        number: int,
        rank: int,
        signature: int,
        description: str,
        call: str,
        carrier: tuple[int, int] | None = None,
        now: float | None = None,
    ) -> _Signed:
        """Keeps the first signature of round `number` of a call check; one
        that differs fails that round, and the round of every piece that
        carried a signature of it (`carrier`: this push's key and round),
        for every rank, naming both ranks and trees. Returns the round's
        record; a carrier's sum waits until it is `agreed` (see `pull`)."""
        rounds = self._signed.setdefault(check_key, {})
        signed = rounds.get(number)
        if signed is None:
            for old in [n for n in rounds if n < number - self.round_window]:
                del rounds[old]  # a rank that left, or a failed round
            now = time.monotonic() if now is None else now
            signed = rounds[number] = _Signed(
                signature, rank, description, call, number, now
            )
        if carrier is not None:
            signed.carriers.add(carrier)
        if signed.error is None and signature != signed.signature:
            again = rank == signed.rank or rank in signed.ranks
            signed.error = StoreError(
                "INVALID_ARGUMENT",
                f"{_wire.MISMATCH_PREFIX}push_pull {call!r} (round "
                f"{number}) differs between ranks: rank {signed.rank} "
                f"pushed [{signed.description}] but rank {rank} pushed "
                f"[{description}]; every rank must push_pull the same "
                "names, shapes and dtypes under one name."
                if not again
                else f"{_wire.MISMATCH_PREFIX}rank {rank} checked round "
                f"{number} of push_pull {call!r} twice, with different "
                f"trees ([{signed.description}], then [{description}]).",
            )
        if signed.error is not None:
            self._settle(signed, (check_key, number))
            raise signed.error
        signed.ranks.add(rank)
        self._agree_if_all(check_key, signed)
        return signed

    def _agree_if_all(self, check_key: int, signed: _Signed) -> None:
        """Settles `signed` if every rank (that has not joined) signed."""
        if len(signed.ranks) < self.num_workers - len(self.joined):
            return
        signed.agreed = True
        rounds = self._signed.get(check_key, {})
        if rounds.get(signed.number) is signed:
            del rounds[signed.number]
            if not rounds:
                del self._signed[check_key]
        self._settle(signed)

    def _settle(self, signed: _Signed, *more: tuple[int, int]) -> None:
        """Wakes the pulls of the rounds that carried `signed` (and of the
        rounds `more`), which it now lets through or fails."""
        for key, number in (*signed.carriers, *more):
            k = self._keys.get(key)
            rnd = None if k is None else k.rounds.get(number)
            if rnd is None:
                continue
            if signed.error is not None:
                rnd.fail(
                    StoreError(
                        signed.error.code,
                        f"round {number} failed: {signed.error.message}",
                    )
                )
                self._wake(rnd)
            elif rnd.total is not None and not _check_pending(rnd):
                self._wake(rnd)  # summed, and now agreed on

    @staticmethod
    def _waits_for_check(rnd: Round) -> _Signed | None:
        """The call check a complete round's sum still waits for (None: it
        may be answered); raises the check's error if it failed."""
        for signed in rnd.signs:
            if signed.error is not None:
                raise signed.error
            if not signed.agreed:
                return signed
        rnd.signs = []
        return None

    def finish_push(
        self, ticket: PushTicket, error: BaseException | None = None
    ) -> None:
        """Wakes the pulls of a round that `ticket.run()` completed, or
        fails its round if `run` raised `error`."""
        rnd = ticket.round
        if error is not None:
            log.error("summing a push failed: %r", error)
            if not isinstance(error, StoreError):
                error = StoreError(
                    "INTERNAL",
                    f"summing the push of rank {ticket.rank} failed: {error!r}",
                )
            self._poison(ticket.key.key, rnd.number, error)
        elif rnd.total is not None:
            self.rounds_completed += 1
            if not _check_pending(rnd):  # else once its check is agreed on
                self._wake(rnd)

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
        self._keys.check_schema(k, dtype_code, length)
        if k.last is not None and k.last.number == round:
            # a retried pull of the round just freed
            return k.last, self._answer(k, k.last, rank, raw, into)
        rnd = self._round(k, round, now)
        if rnd.error is not None:
            raise rnd.error
        if rnd.total is None:
            return rnd, None
        if rnd.signs and self._waits_for_check(rnd) is not None:
            return rnd, None
        return rnd, self._take(k, rnd, rank, raw, into)

    def collect(
        self,
        key: int,
        rnd: Round,
        rank: int,
        raw: bool = False,
        into=None,
        now: float | None = None,
        until: float = 0.0,
    ) -> bytes | np.ndarray | None:
        """Returns the sum of a round that `rank` waited for, as `pull`
        does; fails the round first if it is past its deadline at `now`,
        and raises DEADLINE_EXCEEDED if it is still incomplete. A complete
        round whose call check is not yet agreed on returns None before
        `until` (wait again) and raises DEADLINE_EXCEEDED after it."""
        now = time.monotonic() if now is None else now
        self.fail_if_late(key, rnd, now)
        if rnd.error is not None:
            raise rnd.error
        k = self._keys.get(key)
        waiting = None
        if rnd.total is not None and rnd.signs:
            waiting = self._waits_for_check(rnd)
        if waiting is not None:
            if now < min(until, rnd.deadline):
                return None
            missing = sorted(
                set(range(self.num_workers)) - waiting.ranks - self.joined
            )
            raise StoreError(
                "DEADLINE_EXCEEDED",
                f"round {rnd.number} of key {k.label} is summed, but the call "
                f"check it carried (push_pull {waiting.call!r} round "
                f"{waiting.number}) still waits for rank(s) {missing}.",
            )
        if rnd.total is None:
            missing = self._missing(rnd)
            raise StoreError(
                "DEADLINE_EXCEEDED",
                f"pull of round {rnd.number} of key {k.label} by rank "
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
                    f"{k.label} from a shared-memory slot and must "
                    "pull it into the same slot.",
                )
            return into
        if own is not None:
            return own if raw else self.encode(own, rnd.summed)
        if raw:
            return rnd.total
        if rnd.encoded is None:
            self._reserve(rnd.total.nbytes, f"the sum of key {k.label}")
            rnd.encoded = self.encode(rnd.total, rnd.summed)
        return rnd.encoded

    def _take(self, k: Key, rnd: Round, rank: int, raw: bool, into):
        answer = self._answer(k, rnd, rank, raw, into)
        rnd.pulled.add(rank)
        # every contributor pulled; a rank's second pull that waited beside
        # its first (a retry over gRPC while the data connection that sent
        # the first was lost) finds the round gone already
        if rnd.pulled >= rnd.pushed.keys() and k.rounds.get(rnd.number) is rnd:
            del k.rounds[rnd.number]
            if rnd.number > k.done:
                k.done = rnd.number
                if k.last is not None:
                    self._drop(k.last)
                k.last = rnd
            elif rnd is not k.last:
                self._drop(rnd)
        return answer

    # -- memory ------------------------------------------------------------

    def _reserve(self, nbytes: int, what: str) -> None:
        self.budget.reserve(nbytes, what)
        self.held += nbytes

    def _drop(self, rnd: Round) -> None:
        """Releases what a round no longer needed holds (its encoded sum)."""
        if rnd.encoded is not None:
            n = len(rnd.encoded)
            rnd.encoded = None
            self.budget.release(n)
            self.held -= n

    def close(self) -> None:
        """Frees every key; its memory leaves the budget."""
        self.budget.release(self.held)
        self.held = 0
        self._keys = Keys(self.num_workers, 1)
        self._signed = {}

    # -- expiry ------------------------------------------------------------

    def deadline(self, rnd: Round) -> float:
        """Monotonic time at which `rnd` fails if still incomplete."""
        return rnd.deadline

    def fail_if_late(self, key: int, rnd: Round, now: float) -> None:
        """Fails `rnd` if it is incomplete past its deadline."""
        if rnd.total is None and rnd.error is None and now >= rnd.deadline:
            self._fail(self._keys.get(key), rnd)

    def expire(self, now: float | None = None) -> int:
        """Fails incomplete rounds past their deadline; returns how many."""
        now = time.monotonic() if now is None else now
        failed = 0
        for check_key, rounds in list(self._signed.items()):
            for number, signed in list(rounds.items()):
                if now >= signed.started + 2 * self.round_timeout:
                    del rounds[number]  # e.g. a retry after all agreed
            if not rounds:
                del self._signed[check_key]
        for k in self._keys:
            for rnd in list(k.rounds.values()):
                if rnd.total is None and rnd.error is None:
                    if now >= rnd.deadline:
                        failed += self._fail(k, rnd)
                elif now >= rnd.deadline + self.round_timeout:
                    # failed, or complete and never pulled by every rank:
                    # forget it a round timeout later
                    del k.rounds[rnd.number]
                    k.done = max(k.done, rnd.number)
                    self._drop(rnd)
        return failed

    def abort(
        self,
        *,
        key: int,
        round: int,
        rank: int,
        dtype_code: int,
        length: int,
        name: str,
        reason: str,
        now: float | None = None,
    ) -> None:
        k = self._keys.add(key, dtype_code, length, name)
        if round <= k.done:
            return  # complete or failed already: nobody waits for it
        if k.done == -1 and not k.rounds and k.last is None:
            k.done = round - 1  # (a new key starts at its first round)
        rnd = self._round(k, round, now)
        err = StoreError(
            "ABORTED",
            f"round {round} of key {k.label} failed: rank {rank} gave up "
            f"its push_pull: {reason}",
        )
        if rnd.fail(err):
            k.done = max(k.done, round)
            self._wake(rnd)

    def _poison(self, key: int, number: int, err: StoreError) -> None:
        k = self._keys.get(key)
        rnd = None if k is None else k.rounds.get(number)
        if rnd is not None and rnd.fail(
            StoreError(err.code, f"round {number} failed: {err.message}")
        ):
            self._wake(rnd)

    def _fail(self, k: Key, rnd: Round) -> bool:
        missing = self._missing(rnd)
        failed = rnd.fail(
            StoreError(
                "DEADLINE_EXCEEDED",
                f"round {rnd.number} of key {k.label} timed out after "
                f"{self.round_timeout:g} s waiting for rank(s) {missing} to "
                f"push (ranks {sorted(rnd.pushed)} did).",
            )
        )
        if failed:  # else it completed meanwhile
            k.done = max(k.done, rnd.number)
            self._wake(rnd)
        return failed

    # -- join --------------------------------------------------------------

    def join(self, ranks: frozenset[int]) -> int:
        """The ranks in `ranks` have joined: every live round completes once
        the other ranks pushed (a joined rank's earlier push still counts);
        returns how many completed now."""
        self.joined = frozenset(ranks)
        others = set(range(self.num_workers)) - self.joined
        for check_key, rounds in list(self._signed.items()):
            for signed in list(rounds.values()):
                if signed.error is None:  # fewer ranks must sign now
                    self._agree_if_all(check_key, signed)
        completed = 0
        for k in self._keys:
            dtype = _wire.code_dtype(k.dtype_code)
            for rnd in k.rounds.values():
                if rnd.lower_quorum(len(others | rnd.pushed.keys()), dtype):
                    self.rounds_completed += 1
                    completed += 1
                    self._wake(rnd)
        return completed

    def reset_rounds(self) -> None:
        """Every rank joined: each key starts again at the round of its next
        push (workers start again at 0), and nobody is joined. Rounds still
        live (a rank that never pulled) fail."""
        self.joined = frozenset()
        self._signed = {}
        for k in self._keys:
            for rnd in k.rounds.values():
                if rnd.fail(
                    StoreError(
                        "ABORTED",
                        f"round {rnd.number} of key {k.label} was dropped: "
                        "every rank joined (jaxps.join) before it completed.",
                    )
                ):
                    self._wake(rnd)
                self._drop(rnd)
            if k.last is not None:
                self._drop(k.last)
            k.rounds, k.last, k.done = {}, None, -1

    # -- rounds ------------------------------------------------------------

    def _round(
        self, k: Key, number: int, now: float | None, pusher: int = -1
    ) -> Round:
        rnd = k.rounds.get(number)
        if rnd is not None:
            return rnd
        if number <= k.done:
            raise StoreError(
                "ABORTED",
                f"round {number} of key {k.label} is from the past: "
                f"rounds up to {k.done} are finished.",
            )
        if number > k.done + self.round_window and not self._abandon(
            k, number, pusher
        ):
            raise StoreError(
                "FAILED_PRECONDITION",
                f"round {number} of key {k.label} is too far ahead: "
                f"rounds up to {k.done} are finished and at most "
                f"{self.round_window} may be live.",
            )
        now = time.monotonic() if now is None else now
        rnd = Round(
            number,
            now,
            now + self.round_timeout,
            self._accumulator(k, number),
            quorum=self.num_workers - len(self.joined),
        )
        k.rounds[number] = rnd
        return rnd

    def _abandon(self, k: Key, number: int, pusher: int) -> bool:
        """Fails the oldest live rounds of `k` that no rank can complete,
        until a push of round `number` by rank `pusher` is within the
        window; returns whether it is.

        A round can be left so after a restart: the new server starts a key
        at the round of its first push, and each rank pushes again its last
        completed round, which is one round behind on some ranks. If a
        lagging rank's re-push of round r comes first, the ranks that hold
        round r + 1 never push r again, and r would block the window. It is
        abandoned only if every rank it waits for has pushed a later round
        (they hold its sum; a rank pushes in round order), and never once
        every rank pushed it: its sum is owed. Its waiters, if any, are
        told so.
        """
        while number > k.done + self.round_window:
            oldest = k.rounds.get(k.done + 1)
            if oldest is None or oldest.total is not None:
                return False
            missing = set(self._missing(oldest))
            moved_on = {pusher}.union(
                *(rnd.pushed for n, rnd in k.rounds.items() if n > k.done + 1)
            )
            if oldest.error is None and not (missing and missing <= moved_on):
                return False  # owed by a rank, or every rank's (summing)
            if oldest.fail(
                StoreError(
                    "ABORTED",
                    f"round {oldest.number} of key {k.label} was abandoned: "
                    f"rank(s) {sorted(missing)} pushed later rounds without "
                    "it (after a server restart, each rank pushes its last "
                    "completed round again).",
                )
            ):
                self._wake(oldest)
            k.done = oldest.number
        return True

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
        dtype = _kernels.accumulator_dtype(_wire.code_dtype(k.dtype_code))
        if held is None:  # kept for the key's life: counted in the budget
            self._reserve(
                k.length * dtype.itemsize, f"round {number} of key {k.label}"
            )
        array = np.empty(k.length, dtype)
        if held is None:
            k.buffers[slot] = (array, number)
        return array

    @staticmethod
    def _wake(rnd: Round) -> None:
        waiters, rnd.waiters = rnd.waiters, []
        for wake in waiters:
            wake()

    # -- metrics -----------------------------------------------------------

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    def pending_pulls(self) -> int:
        """Number of pulls waiting for their round to complete."""
        return sum(
            len(rnd.waiters) for k in self._keys for rnd in k.rounds.values()
        )

    def pending_rounds(self) -> int:
        """Number of rounds that are live (incomplete or not fully pulled)."""
        return sum(len(k.rounds) for k in self._keys)
