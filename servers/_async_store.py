"""The store of asynchronous training (BytePS async mode).

The server holds the parameters. The first push of a key (round 0) sets
them; every later push is a delta that is added at once, without waiting for
the other ranks, and every pull answers the current parameters at once.
Exactly-once still holds: a rank's push of a round it already pushed is
acknowledged and not added again.

`AsyncStore` implements `_store.PushPullStore` beside `_store.Store`,
sharing only the key registry (`_store.Keys`).
"""

from __future__ import annotations

import numpy as np

from . import _kernels, _wire
from ._store import Budget, Key, Keys, StoreError


class _Held:
    """A key's held value and each rank's last pushed round."""

    __slots__ = ("value", "last_round")

    def __init__(self):
        self.value: np.ndarray | None = None
        self.last_round: dict[int, int] = {}


class _AsyncTicket:
    __slots__ = ("key", "held", "data", "init")

    def __init__(self, key: Key, held: _Held, data: np.ndarray, init: bool):
        self.key = key
        self.held = held
        self.data = data
        self.init = init

    @property
    def engine(self) -> int:
        return self.key.engine

    def run(self) -> bool:
        held, data = self.held, self.data
        if self.init:
            if held.value is None:  # the first initial value wins
                held.value = data.astype(_kernels.accumulator_dtype(data.dtype))
        elif held.value is None:
            raise StoreError(
                "FAILED_PRECONDITION",
                f"delta for key {self.key.key} ({self.key.name}) before its "
                "initial value (round 0).",
            )
        else:
            np.add(held.value, data, out=held.value, casting="unsafe")
        return True


class AsyncStore:
    """Holds parameters; adds each rank's deltas as they come.

    Args:
      num_workers: number of ranks.
      engine_threads: threads keys are spread over.
      encode: turns the current value (an array) into the pull reply.
    """

    #: A push is acknowledged once added: a refused delta fails its push.
    acks_after_sum = True

    def __init__(
        self,
        num_workers: int,
        *,
        engine_threads: int = 1,
        encode=np.ndarray.tobytes,
        budget: Budget | None = None,
    ):
        self._keys = Keys(num_workers, engine_threads)
        self.budget = Budget() if budget is None else budget
        self.held = 0  # bytes of this store in `budget`
        self._held: dict[int, _Held] = {}
        self.num_workers = num_workers
        self.encode = encode
        self.rounds_completed = 0
        self.bytes_summed = 0
        self.last_round_by_rank: dict[int, int] = {}

    def check_rank(self, rank: int) -> None:
        self._keys.check_rank(rank)

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
    ) -> _AsyncTicket | None:
        """Validates a push; returns its work, or None for a repeat.

        Payloads are always copied or added at once, so `lent` changes
        nothing here; workers send no call checks to async servers.
        """
        del checksum, now, lent, signature, description
        del check_key, check_round, check_call
        dtype = self._keys.check_payload(
            key, rank, dtype_code, length, payload, name
        )
        k = self._keys.add(key, dtype_code, length, name)
        held = self._held.get(key)
        if held is None:
            nbytes = length * _kernels.accumulator_dtype(dtype).itemsize
            self.budget.reserve(nbytes, f"the parameters of key {k.label}")
            self.held += nbytes
            held = self._held[key] = _Held()
        if round <= held.last_round.get(rank, -1):
            return None  # a retry of a round this rank already pushed
        held.last_round[rank] = round
        if round > self.last_round_by_rank.get(rank, -1):
            self.last_round_by_rank[rank] = round
        self.bytes_summed += len(payload)
        data = np.frombuffer(payload, dtype=dtype)
        return _AsyncTicket(k, held, data, init=(round == 0))

    def finish_push(
        self, ticket: _AsyncTicket, error: BaseException | None = None
    ) -> None:
        """Counts an added push; re-raises the `error` of a refused one."""
        if error is not None:
            raise error
        self.rounds_completed += 1

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
    ):
        """Returns the current value at once: (None, encoded value), with
        `raw` (None, the value array), or with `into` (None, `into`) after
        copying the value there."""
        del round, now
        self.check_rank(rank)
        k = self._keys.get(key)
        held = self._held.get(key)
        if k is None or held is None or held.value is None:
            raise StoreError(
                "FAILED_PRECONDITION",
                f"pull of key {key} before its initial value was pushed.",
            )
        self._keys.check_schema(k, dtype_code, length)
        return None, self._answer(k, held, raw, into)

    def collect(
        self, key, rnd, rank, raw=False, into=None, now=None, until=0.0
    ):
        """Answers the current value: `pull` never leaves a pull waiting,
        so there is no round to collect."""
        del rnd, rank, now, until
        return self._answer(self._keys.get(key), self._held[key], raw, into)

    def _answer(self, k: Key, held: _Held, raw: bool, into):
        value = _kernels.cast(held.value, _wire.code_dtype(k.dtype_code))
        if into is not None:
            np.copyto(np.frombuffer(into, value.dtype, value.size), value)
            return into
        return value if raw else self.encode(value)

    def expire(self, now: float | None = None) -> int:
        """Nothing expires: async pushes never wait for each other."""
        return 0

    def join(self, ranks: frozenset[int]) -> int:
        """Nothing to do: async pushes never wait for each other."""
        del ranks
        return 0

    def reset_rounds(self) -> None:
        """Nothing to do: each rank's rounds only tell its retries apart."""

    def abort(self, **chunk) -> None:
        """Nothing to fail: no round waits for another rank here."""
        del chunk

    def close(self) -> None:
        """Frees every key; its memory leaves the budget."""
        self.budget.release(self.held)
        self.held = 0
        self._keys = Keys(self.num_workers, 1)
        self._held = {}

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    def pending_pulls(self) -> int:
        return 0

    def pending_rounds(self) -> int:
        return 0
