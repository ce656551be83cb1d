"""The store of asynchronous training (BytePS async mode).

The server holds the parameters. The first push of a key (round 0) sets
them; every later push is a delta that is added at once, without waiting for
the other ranks, and every pull answers the current parameters at once.
Exactly-once still holds: a rank's push of a round it already pushed is
acknowledged and not added again.
"""

from __future__ import annotations

import numpy as np

from . import _wire
from ._store import Key, Round, Store, StoreError, _accumulator_dtype, _cast


class _AsyncTicket:
    __slots__ = ("key", "data", "init")

    def __init__(self, key: Key, data: np.ndarray, init: bool):
        self.key = key
        self.data = data
        self.init = init

    @property
    def engine(self) -> int:
        return self.key.engine

    def run(self) -> bool:
        k, data = self.key, self.data
        if self.init:
            if k.value is None:  # the first initial value wins
                k.value = data.astype(_accumulator_dtype(data.dtype))
        elif k.value is None:
            raise StoreError(
                "FAILED_PRECONDITION",
                f"delta for key {k.key} ({k.name}) before its initial value "
                "(round 0).",
            )
        else:
            np.add(k.value, data, out=k.value, casting="unsafe")
        return True


class AsyncStore(Store):
    """Holds parameters; adds each rank's deltas as they come.

    Args:
      num_workers: number of ranks.
      engine_threads: threads keys are spread over.
      encode: turns the current value (an array) into the pull reply.
    """

    def __init__(self, num_workers: int, *, engine_threads: int = 1, **kw):
        kw.pop("deterministic", None)
        super().__init__(num_workers, engine_threads=engine_threads, **kw)

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
    ):
        """Validates a push; returns its work, or None for a repeat.

        Payloads are always copied or added at once, so `lent` changes
        nothing here.
        """
        del checksum, now, lent
        k, dtype = self._validate_push(
            key, round, rank, dtype_code, length, payload, name
        )
        last = k.last_round.get(rank, -1)
        if round <= last:
            return None  # a retry of a round this rank already pushed
        k.last_round[rank] = round
        if round > self.last_round_by_rank.get(rank, -1):
            self.last_round_by_rank[rank] = round
        self.bytes_summed += len(payload)
        data = np.frombuffer(payload, dtype=dtype)
        return _AsyncTicket(k, data, init=(round == 0))

    def finish_push(self, ticket) -> None:
        self.rounds_completed += 1

    def pull(
        self,
        *,
        key,
        round,
        rank,
        dtype_code,
        length,
        now=None,
        raw=False,
        into=None,
    ):
        """Returns the current value at once: (None, encoded value), with
        `raw` (None, the value array), or with `into` (None, `into`) after
        copying the value there."""
        del round, now
        self.check_rank(rank)
        k = self._keys.get(key)
        if k is None or k.value is None:
            raise StoreError(
                "FAILED_PRECONDITION",
                f"pull of key {key} before its initial value was pushed.",
            )
        self._check_schema(k, dtype_code, length)
        value = _cast(k.value, _wire.code_dtype(k.dtype_code))
        if into is not None:
            np.copyto(np.frombuffer(into, value.dtype, value.size), value)
            return None, into
        return None, value if raw else self.encode(value)

    def collect(self, key, rnd: Round, rank, raw=False, into=None):
        raise AssertionError("async pulls never wait")  # pragma: no cover

    def expire(self, now: float | None = None) -> int:
        return 0
