"""Exactly-once under random interleavings, and fuzzing of the wire decoding.

Property tests use hypothesis; the server fuzz sends malformed messages to a
real server process and checks it keeps serving well-formed workers.
"""

import random
import struct
import threading
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxps._src.config import Config
from jaxps._src.runtime import Runtime
from jaxps.servers import Store, _codec, _wire
from jaxps.servers import jaxps_pb2 as pb


# The deadline is generous: a loaded 2-core CI machine is slow, not wrong.
@settings(max_examples=2000, deadline=1000)
@given(st.binary(max_size=300))
def test_decoder_never_fails_but_with_decode_error(data):
    try:
        _codec.decode_push(data)
    except _codec.DecodeError:
        pass
    try:
        _codec.decode_pull_reply(data)
    except _codec.DecodeError:
        pass


def _valid_push(length=3):
    h = pb.Header(
        version=1, job_id="j", rank=0, key=5, round=0, dtype=1, length=length
    )
    return _codec.encode_push(h, np.arange(length, dtype=np.float32), 7)


@settings(max_examples=500, deadline=1000)
@given(st.data())
def test_decoder_on_mutated_valid_messages(data):
    raw = bytearray(_valid_push())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        _codec.decode_push(bytes(raw[:cut]))
    except _codec.DecodeError:
        pass


def test_codec_matches_protobuf():
    h = pb.Header(version=1, job_id="j", rank=2, key=9, round=3, dtype=1)
    x = np.arange(5, dtype=np.float32)
    raw = _codec.encode_push(h, x, 0xDEADBEEF)
    msg = pb.PushRequest.FromString(raw)
    assert msg.header == h and msg.checksum == 0xDEADBEEF
    assert msg.payload == x.tobytes()
    h2, payload, checksum, slot = _codec.decode_push(msg.SerializeToString())
    assert h2 == h and bytes(payload) == x.tobytes() and checksum == 0xDEADBEEF
    assert slot is None
    reply = pb.PullReply(incarnation="abc", payload=b"xyz")
    assert _codec.encode_pull_reply("abc", b"xyz") == reply.SerializeToString()


def test_codec_of_shared_memory_slots_matches_protobuf():
    h = pb.Header(version=1, job_id="j", rank=2, key=9, round=3, dtype=1)
    slot = pb.ShmSlot(segment=3, offset=1 << 33)
    raw = _codec.encode_push(h, None, 5, slot)
    msg = pb.PushRequest.FromString(raw)
    assert msg.slot == slot and msg.payload == b"" and msg.checksum == 5
    *_, decoded = _codec.decode_push(msg.SerializeToString())
    assert decoded == slot
    reply = pb.PullReply(incarnation="abc", in_slot=True)
    encoded = _codec.encode_pull_reply("abc", None, in_slot=True)
    assert encoded == reply.SerializeToString()
    assert _codec.decode_pull_reply(encoded) == ("abc", b"", True, 0)
    # the contributors of a sum, as protobuf encodes them
    reply = pb.PullReply(incarnation="abc", payload=b"xy", contributors=3)
    encoded = _codec.encode_pull_reply("abc", b"xy", contributors=3)
    assert pb.PullReply.FromString(encoded) == reply
    assert _codec.decode_pull_reply(reply.SerializeToString()) == (
        "abc",
        b"xy",
        False,
        3,
    )


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 4),
    repeats=st.lists(st.integers(0, 3), min_size=4, max_size=4),
    seed=st.integers(0, 2**32 - 1),
    deterministic=st.booleans(),
)
def test_exactly_once_under_duplicates_and_shuffles(
    n, repeats, seed, deterministic
):
    """Each rank's push of every round arrives 1 + repeats[rank] times (the
    retries of a lost acknowledgement), ranks move at random speeds through 4
    rounds and pull when their pushes are out: the sums are exact, so no
    contribution is counted twice or into another round."""
    rng = random.Random(seed)
    store = Store(n, deterministic=deterministic)
    rounds, code = 4, _wire.dtype_code(np.int64)

    def payload(rank, r):
        return np.full(6, (rank + 1) * 10 ** (r + 1), np.int64)

    at = [0] * n  # each rank's round
    copies = [1 + repeats[rank] for rank in range(n)]
    while min(at) < rounds:
        rank = rng.choice([k for k in range(n) if at[k] < rounds])
        r = at[rank]
        if copies[rank]:
            data = payload(rank, r).tobytes()
            ticket = store.begin_push(
                key=1,
                round=r,
                rank=rank,
                dtype_code=code,
                length=6,
                payload=data,
                checksum=_wire.checksum(data),
            )
            if ticket is not None:
                ticket.run()
                store.finish_push(ticket)
            copies[rank] -= 1
            continue
        _, result = store.pull(
            key=1, round=r, rank=rank, dtype_code=code, length=6
        )
        if result is None:
            continue
        expected = sum(payload(k, r) for k in range(n))
        np.testing.assert_array_equal(np.frombuffer(result, np.int64), expected)
        at[rank] += 1
        copies[rank] = 1 + repeats[rank]
    assert store.pending_rounds() == 0


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(2, 4),
    repeats=st.lists(st.integers(0, 2), min_size=4, max_size=4),
    joins=st.lists(st.integers(0, 2), min_size=4, max_size=4),
    seed=st.integers(0, 2**32 - 1),
    deterministic=st.booleans(),
)
def test_join_counts_each_contribution_once(
    n, repeats, joins, seed, deterministic
):
    """Ranks push 3 rounds with duplicates in random order; rank k joins
    (if joins[k] < 2 and it is not the last rank) after pushing joins[k]
    rounds, and the store hears it at a random later moment. Every sum is
    over the ranks that pushed its round, named in `summed`, exactly."""
    rng = random.Random(seed)
    store = Store(n, deterministic=deterministic)
    rounds, code = 3, _wire.dtype_code(np.int64)
    stop = [joins[k] if k < n - 1 else rounds for k in range(n)]
    joined: set[int] = set()

    def payload(rank, r):
        return np.full(4, (rank + 1) * 10 ** (r + 1), np.int64)

    at = [0] * n
    copies = [1 + repeats[k] for k in range(n)]
    sums = {}
    while True:
        waiting = [k for k in range(n) if k not in joined and at[k] >= stop[k]]
        active = [k for k in range(n) if at[k] < stop[k]]
        if waiting and (not active or rng.random() < 0.3):
            joined.add(rng.choice(waiting))
            store.join(frozenset(joined))
            continue
        if not active:
            break
        rank = rng.choice(active)
        r = at[rank]
        if copies[rank]:
            data = payload(rank, r).tobytes()
            ticket = store.begin_push(
                key=1,
                round=r,
                rank=rank,
                dtype_code=code,
                length=4,
                payload=data,
                checksum=_wire.checksum(data),
            )
            if ticket is not None:
                ticket.run()
                store.finish_push(ticket)
            copies[rank] -= 1
            continue
        rnd, result = store.pull(
            key=1, round=r, rank=rank, dtype_code=code, length=4
        )
        if result is None:
            continue
        contributors = [k for k in range(n) if stop[k] > r]
        expected = sum(payload(k, r) for k in contributors)
        np.testing.assert_array_equal(np.frombuffer(result, np.int64), expected)
        assert rnd.summed == len(contributors)
        sums[r] = rnd.summed
        at[rank] += 1
        copies[rank] = 1 + repeats[rank]
    assert sorted(sums) == list(range(rounds))
    assert store.pending_rounds() == 0


def raw_call(channel, method, data):
    call = channel.unary_unary(f"/jaxps.Summation/{method}")
    try:
        call(data, timeout=5)
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


_SESSIONS: dict[str, str] = {}


def session_of(address: str) -> str:
    """A job incarnation of rank 0 on the server at `address` (one Hello)."""
    if address not in _SESSIONS:
        with grpc.insecure_channel(address) as channel:
            reply = channel.unary_unary(
                "/jaxps.Summation/Hello",
                request_serializer=pb.HelloRequest.SerializeToString,
                response_deserializer=pb.HelloReply.FromString,
            )(
                pb.HelloRequest(
                    version=_wire.PROTOCOL_VERSION,
                    job_id="jaxps",
                    rank=0,
                    num_workers=2,
                    init_id="fuzz",
                ),
                timeout=10,
            )
        _SESSIONS[address] = reply.session
    return _SESSIONS[address]


def header_bytes(session="", **fields):
    base = dict(
        version=_wire.PROTOCOL_VERSION,
        job_id="jaxps",
        session=session,
        rank=0,
        key=1,
        round=0,
        dtype=1,
    )
    base.update(fields)
    return pb.Header(**base)


@pytest.mark.timeout(120)
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.data())
def test_server_survives_malformed_requests(module_server, data):
    server = module_server
    sid = session_of(server.address)
    kind = data.draw(
        st.sampled_from(
            ["random", "length", "dtype", "huge", "join", "signature"]
        )
    )
    if kind == "random":
        method = data.draw(st.sampled_from(["Push", "Pull", "Hello", "Join"]))
        raw = data.draw(st.binary(max_size=200))
    elif kind == "join":  # an epoch never seen, or a bad timeout
        method = "Join"
        epoch = data.draw(st.integers(1, 2**64 - 1))
        timeout = data.draw(st.floats(allow_nan=True, allow_infinity=True))
        raw = pb.JoinRequest(
            header=header_bytes(sid, round=epoch), timeout=timeout
        ).SerializeToString()
    elif kind == "signature":  # call checks of any signature and text
        method = "Push"
        h = header_bytes(
            sid,
            key=data.draw(st.integers(2**41, 2**47)),
            length=1,
            signature=data.draw(st.integers(0, 2**64 - 1)),
            description=data.draw(st.text(max_size=2000)),
            # a check of its own, or one a piece carries
            check_key=data.draw(
                st.one_of(st.just(0), st.integers(1, 2**64 - 1))
            ),
            check_round=data.draw(st.integers(0, 2**64 - 1)),
            check_call=data.draw(st.text(max_size=100)),
        )
        payload = np.ones(1, np.float32)
        raw = _codec.encode_push(h, payload, _wire.fingerprint(payload))
    else:
        method = "Push"
        key = data.draw(st.integers(100, 2**40))
        if kind == "length":
            h = header_bytes(sid, key=key, length=data.draw(st.integers(0, 50)))
            payload = b"\0" * data.draw(st.integers(0, 50))
        elif kind == "dtype":
            h = header_bytes(
                sid,
                key=key,
                length=1,
                dtype=data.draw(st.integers(7, 2**31 - 1)),
            )
            payload = b"\0" * 4
        else:
            h = header_bytes(
                sid, key=key, length=data.draw(st.integers(2**40, 2**63))
            )
            payload = b"\0" * 8
        raw = _codec.encode_push(h, payload, 0)
        if kind == "length" and h.length * 4 == len(payload) and h.length:
            return  # well-formed after all
    with grpc.insecure_channel(server.address) as channel:
        code, details = raw_call(channel, method, raw)
    assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
        code,
        details,
    )
    if kind in ("length", "dtype", "huge"):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert ("length" in details) or ("dtype" in details), details
    if kind == "join":
        assert code in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.FAILED_PRECONDITION,
        ), (code, details)
        assert "timeout" in details or "epoch" in details, details
    if kind == "signature" and not h.check_key:  # accepted: it waits for
        assert code == grpc.StatusCode.OK, (code, details)  # rank 1
    if kind == "signature" and h.check_key:  # or met an earlier example's
        assert code == grpc.StatusCode.OK or (
            code == grpc.StatusCode.INVALID_ARGUMENT
            and details.startswith(_wire.MISMATCH_PREFIX)
        ), (code, details)
    assert server.proc.poll() is None


@pytest.mark.timeout(60)
def test_server_keeps_serving_during_garbage(start_servers):
    (server,) = start_servers(1, 2)
    stop = threading.Event()
    rng = random.Random(0)

    def garbage():
        with grpc.insecure_channel(server.address) as channel:
            while not stop.is_set():
                blob = bytes(rng.randrange(256) for _ in range(64))
                raw_call(channel, "Push", struct.pack("<I", 9) + blob)

    t = threading.Thread(target=garbage, daemon=True)
    t.start()
    try:
        outs = []

        def work(rank):
            cfg = Config(
                servers=(server.address,), num_workers=2, worker_rank=rank
            )
            rt = Runtime(cfg)
            try:
                for i in range(20):
                    outs.append(
                        rt.push_pull(
                            "w", np.full(100, i, np.float32), average=False
                        )
                    )
            finally:
                rt.close()

        workers = [threading.Thread(target=work, args=(r,)) for r in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(30)
        assert len(outs) == 40
    finally:
        stop.set()
        t.join(5)
    time.sleep(0.1)
    assert server.proc.poll() is None
