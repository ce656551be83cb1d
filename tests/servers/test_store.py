"""The summation store, without gRPC."""

import time

import numpy as np
import pytest

from jaxps.servers import Store, StoreError, _kernels, _wire


def begin(store, key, rnd, rank, array, checksum=None, **check):
    """Pushes `array`; returns its ticket, not summed yet (None: a repeat).
    `check`: the call check it carries."""
    payload = array.tobytes()
    return store.begin_push(
        key=key,
        round=rnd,
        rank=rank,
        dtype_code=_wire.dtype_code(array.dtype),
        length=array.size,
        payload=payload,
        checksum=_wire.checksum(payload) if checksum is None else checksum,
        name=f"t{key}",
        **check,
    )


def push(store, key, rnd, rank, array, checksum=None, **check):
    """Pushes `array` and sums it; `check`: the call check it carries."""
    ticket = begin(store, key, rnd, rank, array, checksum, **check)
    if ticket is not None:
        ticket.run()
        store.finish_push(ticket)
    return ticket


def pull(store, key, rnd, rank, like):
    _, result = store.pull(
        key=key,
        round=rnd,
        rank=rank,
        dtype_code=_wire.dtype_code(like.dtype),
        length=like.size,
    )
    return None if result is None else np.frombuffer(result, like.dtype)


DTYPES = _wire.supported_dtypes()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("deterministic", [False, True])
def test_sum_matches_numpy(dtype, n, deterministic):
    store = Store(n, deterministic=deterministic)
    rng = np.random.default_rng(n)
    parts = [rng.integers(-8, 8, size=37).astype(dtype) for _ in range(n)]
    for rank in reversed(range(n)):
        push(store, 7, 0, rank, parts[rank])
    expected = np.sum(np.stack(parts).astype(np.float64), axis=0)
    for rank in range(n):
        got = pull(store, 7, 0, rank, parts[0])
        np.testing.assert_array_equal(got.astype(np.float64), expected)
    assert store.pending_rounds() == 0  # freed after all pulled


def test_incomplete_round_is_not_answered():
    store = Store(2)
    x = np.ones(4, np.float32)
    push(store, 1, 0, 0, x)
    assert pull(store, 1, 0, 0, x) is None


def test_two_waiting_pulls_of_one_rank_are_both_answered():
    # A rank's pull waits on a data connection that is then lost, and its
    # retry over gRPC waits beside it: both get the sum once the round is
    # complete, and the round is freed once.
    store = Store(2)
    x = np.arange(4, dtype=np.float32)
    push(store, 1, 0, 0, x)
    dtype = _wire.dtype_code(x.dtype)
    waiting = [
        store.pull(key=1, round=0, rank=0, dtype_code=dtype, length=4)
        for _ in range(2)
    ]
    assert [result for _, result in waiting] == [None, None]
    push(store, 1, 0, 1, 2 * x)
    first, second = (rnd for rnd, _ in waiting)
    np.testing.assert_array_equal(store.collect(1, first, 0, raw=True), 3 * x)
    np.testing.assert_array_equal(pull(store, 1, 0, 1, x), 3 * x)
    assert store.pending_rounds() == 0  # all pulled: freed
    np.testing.assert_array_equal(store.collect(1, second, 0, raw=True), 3 * x)
    assert store.pending_rounds() == 0


def test_half_precision_accumulates_in_float32():
    n = 4
    store = Store(n)
    x = np.full(3, 2049, np.float16)  # 2049 is not a float16: rounds to 2048
    small = np.full(3, 1, np.float16)
    push(store, 1, 0, 0, x)
    for rank in range(1, n):
        push(store, 1, 0, rank, small)
    got = pull(store, 1, 0, 0, x)
    # float32 accumulation: 2048 + 3 = 2051 -> float16 2052; float16 chain
    # would stay at 2048.
    assert got[0] == np.float16(2051.0)


def test_identical_retry_is_not_counted_twice():
    store = Store(2)
    x = np.arange(5, dtype=np.float32)
    push(store, 1, 0, 0, x)
    assert push(store, 1, 0, 0, x) is None
    push(store, 1, 0, 1, x)
    np.testing.assert_array_equal(pull(store, 1, 0, 0, x), 2 * x)


def test_conflicting_duplicate_is_rejected():
    store = Store(2)
    push(store, 1, 0, 0, np.ones(3, np.float32))
    with pytest.raises(StoreError, match="twice with different payloads") as e:
        push(store, 1, 0, 0, np.zeros(3, np.float32))
    assert e.value.code == "ABORTED"


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(dtype_code=_wire.dtype_code(np.float64)),
            r"dtype of key 1 \(t1\) is float64 but its first push had float32",
        ),
        (
            dict(length=4),
            r"length of key 1 \(t1\) is 4 but its first push had length=3",
        ),
    ],
)
def test_schema_mismatch(change, message):
    store = Store(2)
    push(store, 1, 0, 0, np.ones(3, np.float32))
    args = dict(
        key=1,
        round=0,
        rank=1,
        dtype_code=_wire.dtype_code(np.float32),
        length=3,
        payload=np.ones(3, np.float32).tobytes(),
        checksum=0,
    )
    args.update(change)
    if "length" in change:
        args["payload"] = np.ones(4, np.float32).tobytes()
    else:
        args["payload"] = np.ones(3, np.float64).tobytes()
    with pytest.raises(StoreError, match=message) as e:
        store.begin_push(**args)
    assert e.value.code == "INVALID_ARGUMENT"


def test_payload_size_must_match_length():
    store = Store(1)
    with pytest.raises(StoreError, match="has 8 bytes but length=3"):
        store.begin_push(
            key=1,
            round=0,
            rank=0,
            dtype_code=1,
            length=3,
            payload=b"\0" * 8,
            checksum=0,
        )


def test_unknown_dtype_and_rank_out_of_range():
    store = Store(2)
    with pytest.raises(StoreError, match="unknown dtype code 99"):
        store.begin_push(
            key=1,
            round=0,
            rank=0,
            dtype_code=99,
            length=1,
            payload=b"\0" * 4,
            checksum=0,
        )
    with pytest.raises(StoreError, match="rank 2 out of range"):
        push(store, 1, 0, 2, np.ones(1, np.float32))


def test_rounds_from_the_past_and_too_far_ahead():
    store = Store(1)
    x = np.ones(2, np.float32)
    for rnd in (0, 1):
        push(store, 1, rnd, 0, x)
        pull(store, 1, rnd, 0, x)
    with pytest.raises(StoreError, match="from the past") as e:
        push(store, 1, 0, 0, x)
    assert e.value.code == "ABORTED"
    # The round just freed is kept for retries (a PushPull whose reply was
    # lost): an identical push is acknowledged, not summed; another is not.
    assert push(store, 1, 1, 0, x) is None
    np.testing.assert_array_equal(pull(store, 1, 1, 0, x), x)
    with pytest.raises(StoreError, match="different payloads") as e:
        push(store, 1, 1, 0, 2 * x)
    assert e.value.code == "ABORTED"
    with pytest.raises(StoreError, match="too far ahead") as e:
        push(store, 1, 5, 0, x)
    assert e.value.code == "FAILED_PRECONDITION"


def test_a_round_only_a_lagging_rank_pushed_again_is_abandoned():
    # After a restart: rank 1's last completed round was 16 and its re-push
    # came first, so the key starts at 16; rank 0 completed 17 and pushes
    # only 17 again (no pull). Rank 0 never pushes 16: its next push, round
    # 18, abandons 16 instead of being refused as too far ahead.
    store = Store(2)
    x = np.ones(3, np.float32)
    push(store, 1, 16, 1, 5 * x)  # rank 1's re-push
    push(store, 1, 17, 0, x)  # rank 0's re-push
    push(store, 1, 17, 1, x)  # rank 1's push_pull of the round it lost
    np.testing.assert_array_equal(pull(store, 1, 17, 1, x), 2 * x)
    push(store, 1, 18, 0, 3 * x)
    with pytest.raises(StoreError, match="abandoned") as e:
        pull(store, 1, 16, 1, x)
    assert e.value.code == "ABORTED" and "rank(s) [0]" in e.value.message
    push(store, 1, 18, 1, 4 * x)
    for rank in range(2):
        np.testing.assert_array_equal(pull(store, 1, 18, rank, x), 7 * x)
    # a round that a rank still owes is not abandoned: still too far ahead
    push(store, 2, 0, 0, x)
    push(store, 2, 1, 0, x)
    with pytest.raises(StoreError, match="too far ahead"):
        push(store, 2, 2, 0, x)
    # nor one every rank pushed, still being summed
    push(store, 4, 0, 0, x)
    summing = begin(store, 4, 0, 1, x)
    push(store, 4, 1, 0, x)
    push(store, 4, 1, 1, x)
    with pytest.raises(StoreError, match="too far ahead"):
        push(store, 4, 2, 0, x)
    summing.run()
    store.finish_push(summing)
    np.testing.assert_array_equal(pull(store, 4, 0, 1, x), 2 * x)
    # nor a complete one whose sum the ranks have not pulled yet
    push(store, 3, 0, 0, x)
    push(store, 3, 0, 1, x)
    push(store, 3, 1, 1, x)
    with pytest.raises(StoreError, match="too far ahead"):
        push(store, 3, 2, 1, x)
    np.testing.assert_array_equal(pull(store, 3, 0, 0, x), 2 * x)


def test_consecutive_rounds_overlap_by_one():
    store = Store(2)
    x = np.ones(2, np.float32)
    push(store, 1, 0, 0, x)
    push(store, 1, 0, 1, x)
    pull(store, 1, 0, 0, x)
    push(store, 1, 1, 0, 3 * x)  # rank 0 is ahead; rank 1 has not pulled
    np.testing.assert_array_equal(pull(store, 1, 0, 1, x), 2 * x)
    push(store, 1, 1, 1, x)
    np.testing.assert_array_equal(pull(store, 1, 1, 1, x), 4 * x)


def test_timeout_names_missing_ranks():
    store = Store(3, round_timeout=5.0)
    x = np.ones(2, np.float32)
    push(store, 1, 0, 1, x)
    assert store.expire(now=1e12) == 1
    with pytest.raises(StoreError, match=r"waiting for rank\(s\) \[0, 2\]"):
        pull(store, 1, 0, 1, x)


def test_deterministic_mode_is_bitwise_independent_of_arrival():
    rng = np.random.default_rng(0)
    parts = [
        rng.standard_normal(1000).astype(np.float32) * 10**i for i in range(4)
    ]
    results = set()
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
        store = Store(4, deterministic=True)
        for rank in order:
            push(store, 1, 0, rank, parts[rank])
        results.add(pull(store, 1, 0, 0, parts[0]).tobytes())
    assert len(results) == 1


def test_pull_retried_after_the_round_was_freed():
    store = Store(2)
    x = np.ones(3, np.float32)
    push(store, 1, 0, 0, x)
    push(store, 1, 0, 1, x)
    pull(store, 1, 0, 0, x)
    pull(store, 1, 0, 1, x)  # the last pull frees the round ...
    assert store.pending_rounds() == 0
    # ... but its reply may be lost: the retry gets the same sum
    np.testing.assert_array_equal(pull(store, 1, 0, 1, x), 2 * x)
    push(store, 1, 1, 0, x)
    push(store, 1, 1, 1, 3 * x)
    pull(store, 1, 1, 0, x)
    pull(store, 1, 1, 1, x)
    with pytest.raises(StoreError, match="from the past"):
        pull(store, 1, 0, 0, x)  # only the latest round is kept


def test_failed_round_never_answers_an_older_sum():
    store = Store(2, round_timeout=1.0)
    x = np.ones(3, np.float32)
    for rank in (0, 1):
        push(store, 1, 0, rank, x)
    for rank in (0, 1):
        pull(store, 1, 0, rank, x)
    push(store, 1, 1, 0, x)  # rank 1 never pushes round 1
    store.expire(now=1e12)
    with pytest.raises(StoreError, match="timed out"):
        pull(store, 1, 1, 0, x)


def raw_pull(store, key, rnd, rank, like):
    _, total = store.pull(
        key=key,
        round=rnd,
        rank=rank,
        dtype_code=_wire.dtype_code(like.dtype),
        length=like.size,
        raw=True,
    )
    return total


@pytest.mark.parametrize("deterministic", [False, True])
def test_accumulators_are_reused_without_mixing_rounds(deterministic):
    store = Store(2, deterministic=deterministic)
    x = np.ones(4, np.float32)
    totals = []
    for rnd in range(7):
        push(store, 1, rnd, 0, x * rnd)
        push(store, 1, rnd, 1, x)
        totals.append(raw_pull(store, 1, rnd, 0, x))
        raw_pull(store, 1, rnd, 1, x)
        np.testing.assert_array_equal(totals[-1], x * (rnd + 1))
    # round_window + 1 = 3 arrays, taken in turn
    assert len({id(t) for t in totals}) == 3
    assert totals[0] is totals[3] is totals[6]


def test_reused_accumulator_never_overwrites_a_waiting_round():
    # Round 0 is complete but rank 1 has not pulled it; round 1 fails, so
    # round 3, whose accumulator slot is round 0's, may start meanwhile.
    store = Store(2, round_timeout=1.0)
    x = np.ones(3, np.float32)
    push(store, 1, 0, 0, x)
    push(store, 1, 0, 1, 2 * x)
    raw_pull(store, 1, 0, 0, x)
    push(store, 1, 1, 0, x)
    # round 1 times out (rounds up to 1 are done); round 0, complete, is
    # kept for rank 1 until a round timeout after its deadline
    store.expire(now=time.monotonic() + 1.2)
    push(store, 1, 2, 0, x)
    push(store, 1, 2, 1, x)
    push(store, 1, 3, 0, 10 * x)
    push(store, 1, 3, 1, 10 * x)
    np.testing.assert_array_equal(raw_pull(store, 1, 0, 1, x), 3 * x)
    np.testing.assert_array_equal(raw_pull(store, 1, 3, 1, x), 20 * x)


def lend(store, key, rnd, rank, array):
    """Pushes `array` from a slot lent to the store; returns the slot."""
    slot = bytearray(array.tobytes())
    ticket = store.begin_push(
        key=key,
        round=rnd,
        rank=rank,
        dtype_code=_wire.dtype_code(array.dtype),
        length=array.size,
        payload=memoryview(slot),
        checksum=rank,
        lent=True,
    )
    ticket.run()
    store.finish_push(ticket)
    return slot


def pull_into(store, key, rnd, rank, like, slot):
    _, got = store.pull(
        key=key,
        round=rnd,
        rank=rank,
        dtype_code=_wire.dtype_code(like.dtype),
        length=like.size,
        into=memoryview(slot),
    )
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_lent_slots_receive_the_sum(n, deterministic, dtype):
    store = Store(n, deterministic=deterministic)
    rng = np.random.default_rng(n)
    parts = [rng.integers(-8, 8, size=9).astype(dtype) for _ in range(n)]
    slots = [lend(store, 1, 0, rank, parts[rank]) for rank in range(n)]
    expected = np.sum(np.stack(parts).astype(np.float64), axis=0)
    for slot in slots:
        # the sum is in every slot before anyone pulls
        got = np.frombuffer(slot, dtype).astype(np.float64)
        np.testing.assert_array_equal(got, expected)
    for rank, slot in enumerate(slots):
        assert pull_into(store, 1, 0, rank, parts[0], slot) is not None
        slot[:] = bytes(len(slot))  # the owner reuses its slot at once
    assert store.pending_rounds() == 0


@pytest.mark.parametrize("n", [2, 3])
def test_lent_sum_spanning_many_blocks(n):
    # the last add and the copies into the other slots go block by block
    size = 5 * _kernels.BLOCK_BYTES // 4 + 3
    store = Store(n)
    parts = [np.arange(size, dtype=np.float32) * (r + 1) for r in range(n)]
    slots = [lend(store, 1, 0, rank, parts[rank]) for rank in range(n)]
    expected = np.sum(parts, axis=0)
    for rank, slot in enumerate(slots):
        pull_into(store, 1, 0, rank, parts[0], slot)
        np.testing.assert_array_equal(np.frombuffer(slot, np.float32), expected)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("lenders", [(0,), (1,), (0, 2)])
def test_lent_and_grpc_pushes_mix(lenders, deterministic):
    # A lender's slot may hold the running sum; gRPC pullers must still get
    # the sum after every lender pulled and reused its slot.
    store = Store(3, deterministic=deterministic)
    xs = [np.arange(6, dtype=np.float32) * (r + 1) for r in range(3)]
    slots = {}
    for rank in range(3):
        if rank in lenders:
            slots[rank] = lend(store, 1, 0, rank, xs[rank])
        else:
            push(store, 1, 0, rank, xs[rank])
    for rank, slot in slots.items():
        pull_into(store, 1, 0, rank, xs[0], slot)
        np.testing.assert_array_equal(
            np.frombuffer(slot, np.float32), 6 * xs[0]
        )
        slot[:] = b"\xff" * len(slot)
    for rank in set(range(3)) - set(lenders):
        np.testing.assert_array_equal(pull(store, 1, 0, rank, xs[0]), 6 * xs[0])


def test_lender_must_pull_into_its_slot():
    store = Store(2)
    x = np.ones(4, np.float32)
    slot = lend(store, 1, 0, 0, x)
    push(store, 1, 0, 1, x)
    with pytest.raises(StoreError, match="into the same slot"):
        pull_into(store, 1, 0, 0, x, bytearray(x.nbytes))
    # a pull without a slot gets the sum from the lender's own slot
    np.testing.assert_array_equal(pull(store, 1, 0, 0, x), 2 * x)
    assert np.frombuffer(slot, np.float32).tolist() == [2.0] * 4


def test_retried_pull_of_a_lender_after_the_round_was_freed():
    store = Store(2)
    x = np.ones(4, np.float32)
    slots = [lend(store, 1, 0, rank, x * (rank + 1)) for rank in range(2)]
    for rank in range(2):
        pull_into(store, 1, 0, rank, x, slots[rank])
    slots[0][:] = bytes(len(slots[0]))  # rank 0 reused its slot
    assert store.pending_rounds() == 0
    # rank 1's reply was lost: its retry still finds the sum in its slot
    pull_into(store, 1, 0, 1, x, slots[1])
    np.testing.assert_array_equal(np.frombuffer(slots[1], np.float32), 3 * x)


# -- call checks and join ----------------------------------------------------


def check(store, rnd, rank, signature, description, key=99):
    payload = np.ones(1, np.int32).tobytes()
    return store.begin_push(
        key=key,
        round=rnd,
        rank=rank,
        dtype_code=_wire.dtype_code(np.int32),
        length=1,
        payload=payload,
        checksum=_wire.checksum(payload),
        name="grads@0",
        signature=signature,
        description=description,
    )


def test_a_differing_call_check_fails_the_round_for_everyone():
    store = Store(3)
    first = check(store, 0, 2, 11, "['w'] float32[3, 4]")
    first.run()
    store.finish_push(first)
    check(store, 0, 0, 11, "['w'] float32[3, 4]").run()  # the same: fine
    with pytest.raises(StoreError) as err:
        check(store, 0, 1, 12, "['w'] float32[3, 5]")
    assert err.value.code == "INVALID_ARGUMENT"
    message = err.value.message
    assert message.startswith(_wire.MISMATCH_PREFIX)
    assert "'grads@0'" in message
    assert "rank 2 pushed [['w'] float32[3, 4]]" in message
    assert "rank 1 pushed [['w'] float32[3, 5]]" in message
    # the ranks already waiting on the round get the same error
    with pytest.raises(StoreError, match="rank 1 pushed"):
        store.pull(key=99, round=0, rank=0, dtype_code=5, length=1)
    # the next round is checked afresh
    for rank in range(3):
        ticket = check(store, 1, rank, 13, "x")
        ticket.run()
        store.finish_push(ticket)
    assert store.pull(key=99, round=1, rank=0, dtype_code=5, length=1)[1]


def carry(store, key, rnd, rank, array, signature, description, number=0):
    """A push of `array` that carries the call check (key 99, `number`)."""
    return push(
        store,
        key,
        rnd,
        rank,
        array,
        signature=signature,
        description=description,
        check_key=99,
        check_round=number,
        check_call="grads@0",
    )


def test_checks_carried_by_pieces_that_agree_cost_nothing_more():
    store = Store(2)
    x = np.arange(4, dtype=np.float32)
    for number in range(3):  # rounds of the data and of the check
        for rank in range(2):
            carry(store, 7, number, rank, x, 11, "['w'] float32[4]", number)
        for rank in range(2):
            np.testing.assert_array_equal(
                pull(store, 7, number, rank, x), 2 * x
            )
    assert store.pending_rounds() == 0 and not store._signed


@pytest.mark.parametrize("same_key", [True, False])
def test_a_carried_check_that_differs_fails_every_carrier(same_key):
    store = Store(2)
    x = np.ones(4, np.float32)
    carry(store, 7, 0, 0, x, 11, "['w'] float32[4]")
    other = np.ones(5, np.float32)  # another length: named as a mismatch
    with pytest.raises(StoreError) as err:
        carry(store, 7 if same_key else 8, 0, 1, other, 12, "['w'] float32[5]")
    message = err.value.message
    assert message.startswith(_wire.MISMATCH_PREFIX), message
    assert "'grads@0'" in message
    assert "rank 0 pushed [['w'] float32[4]]" in message
    assert "rank 1 pushed [['w'] float32[5]]" in message
    # rank 0, waiting on its piece's round, hears the same at once
    with pytest.raises(StoreError, match="rank 1 pushed") as waiting:
        pull(store, 7, 0, 0, x)
    assert _wire.MISMATCH_PREFIX in waiting.value.message


@pytest.mark.parametrize("agree", [True, False])
def test_a_carrier_sum_waits_until_every_rank_signed(agree):
    # rank 0's carrier is key 7; rank 1 pushes key 7 plainly and carries
    # its check on key 8 (another plan), which comes last
    store = Store(2)
    x = np.ones(4, np.float32)
    carry(store, 7, 0, 0, x, 11, "['a'] float32[4], ['b'] float32[4]")
    push(store, 7, 0, 1, x)  # key 7 is summed ...
    assert pull(store, 7, 0, 0, x) is None  # ... but not yet answered
    y = np.ones(3, np.float32)
    if agree:  # the same tree: the sum goes out
        carry(store, 8, 0, 1, y, 11, "['a'] float32[4], ['b'] float32[4]")
        np.testing.assert_array_equal(pull(store, 7, 0, 0, x), 2 * x)
        np.testing.assert_array_equal(pull(store, 7, 0, 1, x), 2 * x)
        return
    with pytest.raises(StoreError, match="rank 1 pushed"):
        carry(store, 8, 0, 1, y, 12, "['z'] float32[3], ['a'] float32[4]")
    for rank in range(2):  # the summed round fails for everyone
        with pytest.raises(StoreError) as err:
            pull(store, 7, 0, rank, x)
        assert err.value.message.startswith(_wire.MISMATCH_PREFIX)


def test_a_carrier_another_rank_contradicts_is_named_a_mismatch():
    store = Store(2)
    push(store, 7, 0, 0, np.ones(4, np.float32))  # rank 0, no check yet
    with pytest.raises(StoreError) as err:
        carry(store, 7, 0, 1, np.ones(5, np.float32), 12, "['w'] float32[5]")
    message = err.value.message
    assert message.startswith(_wire.MISMATCH_PREFIX), message
    assert "rank 1 pushed [['w'] float32[5]]" in message
    assert "length" in message


def test_a_join_lets_a_carried_check_agree_among_the_others():
    store = Store(3)
    x = np.ones(4, np.float32)
    for rank in range(2):
        carry(store, 7, 0, rank, x, 11, "['w'] float32[4]")
    assert store.join(frozenset({2})) == 1  # key 7 completes over 2 ranks
    np.testing.assert_array_equal(pull(store, 7, 0, 0, x), 2 * x)
    assert not store._signed


def test_a_stale_carried_check_expires():
    store = Store(2, round_timeout=0.1)
    x = np.ones(4, np.float32)
    carry(store, 7, 0, 0, x, 11, "['w'] float32[4]")  # rank 1 never comes
    assert store._signed
    store.expire(time.monotonic() + 1.0)
    assert not store._signed


def test_a_check_of_its_own_meets_a_carried_one():
    # a rank whose plan sends no piece to the check's server checks alone
    store = Store(2)
    check(store, 0, 0, 11, "['w'] float32[4]").run()
    with pytest.raises(StoreError, match="rank 1 pushed"):
        carry(store, 7, 0, 1, np.ones(5, np.float32), 12, "['w'] float32[5]")
    with pytest.raises(StoreError, match="rank 1 pushed"):  # rank 0 hears it
        store.pull(key=99, round=0, rank=0, dtype_code=5, length=1)
    store = Store(2)  # the other way round
    carry(store, 7, 0, 0, np.ones(4, np.float32), 11, "['w'] float32[4]")
    with pytest.raises(StoreError, match="rank 1 pushed"):
        check(store, 0, 1, 12, "['w'] float32[5]")
    with pytest.raises(StoreError, match="rank 1 pushed"):
        pull(store, 7, 0, 0, np.ones(4, np.float32))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("summed_before_join", [False, True])
def test_join_completes_a_waiting_round_over_the_others(
    deterministic, summed_before_join
):
    store = Store(3, deterministic=deterministic)
    x = np.arange(5, dtype=np.float32)
    push(store, 1, 0, 0, x)  # rank 0 pushed before it joined: it counts
    ticket = begin(store, 1, 0, 2, 10 * x)
    if summed_before_join:
        ticket.run()
        store.finish_push(ticket)
    assert pull(store, 1, 0, 2, x) is None
    assert store.join(frozenset({0, 1})) == int(summed_before_join)
    if not summed_before_join:  # the late sum completes it
        assert ticket.run()
        store.finish_push(ticket)
    rnd, raw = store.pull(key=1, round=0, rank=2, dtype_code=1, length=5)
    np.testing.assert_array_equal(np.frombuffer(raw, np.float32), 11 * x)
    assert rnd.summed == 2  # the contributors the reply names
    np.testing.assert_array_equal(pull(store, 1, 0, 0, x), 11 * x)
    assert store.pending_rounds() == 0  # every contributor pulled
    # a round that starts after the join needs rank 2 alone
    push(store, 1, 1, 2, x)
    np.testing.assert_array_equal(pull(store, 1, 1, 2, x), x)
    # a joined rank may not push
    with pytest.raises(StoreError, match="after it joined") as err:
        push(store, 1, 2, 1, x)
    assert err.value.code == "FAILED_PRECONDITION"


def test_a_joined_rank_is_not_named_as_missing():
    store = Store(3, round_timeout=1.0)
    x = np.ones(2, np.float32)
    store.join(frozenset({1}))
    push(store, 1, 0, 0, x)
    assert pull(store, 1, 0, 0, x) is None
    assert store.expire(time.monotonic() + 5) == 1
    with pytest.raises(StoreError, match=r"waiting for rank\(s\) \[2\]"):
        pull(store, 1, 0, 0, x)


def test_reset_rounds_starts_every_key_again():
    store = Store(2)
    x = np.ones(3, np.float32)
    for rnd in range(3):  # rank 1 joined after round 0: rank 0 goes on
        push(store, 1, rnd, 0, x)
        if rnd == 0:
            push(store, 1, rnd, 1, x)
            pull(store, 1, rnd, 1, x)
            store.join(frozenset({1}))
        pull(store, 1, rnd, 0, x)
    store.reset_rounds()  # every rank joined
    assert store.joined == frozenset() and store.pending_rounds() == 0
    for rank in range(2):  # the next epoch: both at round 0 again
        push(store, 1, 0, rank, (rank + 1) * x)
    for rank in range(2):
        np.testing.assert_array_equal(pull(store, 1, 0, rank, x), 3 * x)
