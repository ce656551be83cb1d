"""The threading rule of a round: its sum state changes under its lock."""

import threading

import numpy as np
import pytest

from jaxps.servers import Store, StoreError, _round, _wire


def begin(store, rank, array, rnd=0):
    payload = array.tobytes()
    return store.begin_push(
        key=1,
        round=rnd,
        rank=rank,
        dtype_code=_wire.dtype_code(array.dtype),
        length=array.size,
        payload=payload,
        checksum=_wire.checksum(payload),
    )


def test_failure_waits_for_a_running_sum(monkeypatch):
    # The engine thread is inside `run` of round 0 when the event loop
    # times the round out: the failure takes the round's lock, so it waits
    # and then drops what the sum left, instead of racing with it.
    store = Store(3, round_timeout=1.0)
    x = np.ones(4, np.float32)
    first = begin(store, 0, x)
    first.run()
    store.finish_push(first)
    adding, release = threading.Event(), threading.Event()
    real = _round._sum_into

    def slow_sum_into(*args):
        adding.set()
        assert release.wait(10)
        return real(*args)

    monkeypatch.setattr(_round, "_sum_into", slow_sum_into)
    second = begin(store, 1, x)
    engine = threading.Thread(target=second.run)
    engine.start()
    assert adding.wait(10)
    expired = []
    loop = threading.Thread(target=lambda: expired.append(store.expire(1e12)))
    loop.start()
    loop.join(0.2)
    assert loop.is_alive(), "the failure did not wait for the running sum"
    release.set()
    engine.join(10)
    loop.join(10)
    rnd = second.round
    assert expired == [1]
    assert rnd.error is not None and rnd.error.code == "DEADLINE_EXCEEDED"
    assert rnd.parts == {} and rnd.total is None
    with pytest.raises(StoreError, match="timed out"):
        store.collect(1, rnd, 0)


def test_a_complete_round_is_never_failed():
    # `Round.fail` checks and sets under the lock: a round that completed
    # meanwhile keeps its sum, and the expiry does not count it.
    store = Store(2, round_timeout=1.0)
    x = np.ones(3, np.float32)
    tickets = [begin(store, rank, x) for rank in range(2)]
    for ticket in tickets:
        ticket.run()
    rnd = tickets[0].round
    assert not rnd.fail(StoreError("ABORTED", "late"))
    assert rnd.error is None
    store._fail(store._keys.get(1), rnd)  # as the expiry would, too late
    assert rnd.error is None
    np.testing.assert_array_equal(store.collect(1, rnd, 0, raw=True), 2 * x)


def test_the_sum_state_is_frozen_once_total_is_set():
    store = Store(1)
    x = np.ones(2, np.float32)
    ticket = begin(store, 0, x)
    assert ticket.run()
    with pytest.raises(AssertionError, match="whose sum is finished"):
        ticket.run()


def test_run_holds_the_round_lock(monkeypatch):
    store = Store(2)
    x = np.ones(2, np.float32)
    ticket = begin(store, 0, x)
    held = []
    real = _round.PushTicket._add

    def add(self):
        held.append(self.round.lock.locked())
        return real(self)

    monkeypatch.setattr(_round.PushTicket, "_add", add)
    ticket.run()
    assert held == [True] and not ticket.round.lock.locked()
