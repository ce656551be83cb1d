"""The async-mode store: initial value, deltas at once, exactly-once."""

import numpy as np
import pytest

from jaxps.servers import Store, StoreError, _store, _wire
from jaxps.servers._async_store import AsyncStore


def push(store, rnd, rank, array):
    ticket = store.begin_push(
        key=1,
        round=rnd,
        rank=rank,
        dtype_code=_wire.dtype_code(array.dtype),
        length=array.size,
        payload=array.tobytes(),
        checksum=0,
    )
    if ticket is not None:
        ticket.run()
        store.finish_push(ticket)
    return ticket


def value(store, like):
    _, raw = store.pull(
        key=1,
        round=0,
        rank=0,
        dtype_code=_wire.dtype_code(like.dtype),
        length=like.size,
    )
    return np.frombuffer(raw, like.dtype)


def test_initial_value_then_deltas_without_barrier():
    store = AsyncStore(2)
    w = np.array([1.0, 2.0], np.float32)
    push(store, 0, 1, w)  # rank 1 initializes
    push(store, 0, 0, w * 100)  # a later initial value is ignored
    np.testing.assert_array_equal(value(store, w), w)
    push(store, 1, 0, np.full(2, 0.5, np.float32))  # rank 0 runs ahead
    push(store, 2, 0, np.full(2, 0.5, np.float32))
    np.testing.assert_array_equal(value(store, w), w + 1)
    assert push(store, 2, 0, np.full(2, 9.0, np.float32)) is None  # retry
    push(store, 1, 1, np.full(2, -1.0, np.float32))
    np.testing.assert_array_equal(value(store, w), w)


def test_half_precision_is_held_in_float32():
    store = AsyncStore(1)
    push(store, 0, 0, np.full(1, 2048, np.float16))
    for r in range(1, 5):
        push(store, r, 0, np.full(1, 1, np.float16))
    assert value(store, np.zeros(1, np.float16))[0] == 2052


def test_pull_before_initial_value():
    store = AsyncStore(1)
    with pytest.raises(StoreError, match="before its initial value"):
        value(store, np.zeros(2, np.float32))


def test_a_sibling_of_store_with_the_same_interface():
    assert not issubclass(AsyncStore, Store)
    for store in (AsyncStore(2), Store(2)):
        assert isinstance(store, _store.PushPullStore)


def test_refused_delta_fails_its_push():
    store = AsyncStore(1)
    ticket = store.begin_push(
        key=1,
        round=1,
        rank=0,
        dtype_code=_wire.dtype_code(np.float32),
        length=1,
        payload=np.ones(1, np.float32).tobytes(),
        checksum=0,
    )
    with pytest.raises(StoreError, match="before its initial value") as e:
        try:
            ticket.run()
        except StoreError as err:
            store.finish_push(ticket, err)
    assert e.value.code == "FAILED_PRECONDITION"
