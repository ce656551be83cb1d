"""Payloads through shared memory to servers on the same host."""

import contextlib
import fcntl
import os
import secrets
import socket
import time

import numpy as np
import pytest

from jaxps import errors
from jaxps._src.config import Config
from jaxps._src.runtime import Runtime
from jaxps._src.transport import shm
from jaxps._src.transport.client import ServerClient
from jaxps.servers import _codec, _shm, _wire
from jaxps.servers import jaxps_pb2 as pb

from .test_runtime import run_workers

PARTITION = 64 * 1024


def test_is_local():
    assert shm.is_local("127.0.0.1:1") and shm.is_local("127.9.9.9:1")
    assert shm.is_local("localhost:1") and shm.is_local("[::1]:1")
    assert not shm.is_local("10.0.0.1:1") and not shm.is_local("host:1")


@pytest.mark.timeout(60)
def test_shared_memory_carries_the_payloads(start_servers):
    servers = start_servers(2, 2)
    x = np.arange(10 * PARTITION // 4, dtype=np.float32)

    def fn(rt):
        pools = [getattr(t, "pool", None) for t in rt._transports]
        sums = [rt.push_pull(f"t{i}", x * (rt.rank + 1)) for i in range(3)]
        return sums, [len(p.segment_ids) for p in pools if p is not None]

    for sums, segments in run_workers(
        2, servers, fn, partition_bytes=PARTITION, transport="shm"
    ):
        assert segments and min(segments) >= 1  # both servers use it
        for got in sums:
            np.testing.assert_array_equal(got, 1.5 * x)
    # segments are memfds: no file is ever left in /dev/shm
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("jaxps-")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "auto"])
def test_small_pool_falls_back_without_waiting(
    start_servers, monkeypatch, transport
):
    # One segment of 2 slots for 40 chunks in flight: most go as bytes, in
    # gRPC messages ("shm") or on the data channel ("auto").
    monkeypatch.setattr(shm, "SMALL_BYTES", 0)  # all would take a slot
    pushes = [0]
    real = ServerClient.push

    def counted(self, *args, **kwargs):
        pushes[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ServerClient, "push", counted)
    servers = start_servers(1, 2)
    x = np.ones(20 * PARTITION // 4, dtype=np.float32)

    def fn(rt):
        pool = rt._transports[0].pool
        pool.slots_per_segment = 2
        pool.segment_bytes = 2 * PARTITION
        pool.max_segments = 1
        return [rt.push_pull(f"t{i}", x, average=False) for i in range(3)]

    for sums in run_workers(
        2, servers, fn, partition_bytes=PARTITION, transport=transport
    ):
        for got in sums:
            np.testing.assert_array_equal(got, 2 * x)
    if transport == "auto":  # none in gRPC messages
        assert pushes[0] == 0
    else:
        assert pushes[0] > 0


@pytest.mark.timeout(60)
def test_server_on_another_host_falls_back_to_grpc(start_servers, monkeypatch):
    # The server's Unix socket cannot be reached, as from another host (or
    # another network namespace): every payload goes through gRPC.
    hello = ServerClient.hello

    def elsewhere(self, **kw):
        out = hello(self, **kw)
        self.shm_socket = "jaxps-no-such-socket-" + secrets.token_hex(8)
        return out

    monkeypatch.setattr(ServerClient, "hello", elsewhere)
    servers = start_servers(1, 2)
    x = np.arange(3 * PARTITION // 4, dtype=np.float32)

    def fn(rt):
        got = rt.push_pull("t", x, average=False)
        pool = getattr(rt._transports[0], "pool", None)
        return got, pool is None or not pool.enabled

    for got, fell_back in run_workers(
        2, servers, fn, partition_bytes=PARTITION, transport="shm"
    ):
        assert fell_back
        np.testing.assert_array_equal(got, 2 * x)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("partition_bytes", [8, 16, 24])
def test_tiny_partitions_through_shared_memory(start_servers, partition_bytes):
    # A segment holds 16 MiB of slots: a million of 16 bytes. They were all
    # made when the segment was added, which took each worker longer than
    # its 11.5 s wait before its first push went out (and the servers,
    # which never saw one, had nothing to answer).
    servers = start_servers(2, 3)
    x = np.arange(12, dtype=np.int32)

    def fn(rt):
        started = time.monotonic()
        got = rt.push_pull("x", x * (rt.rank + 1), average=False)
        pools = [t.pool for t in rt._transports]
        return got, time.monotonic() - started, pools

    for got, took, pools in run_workers(
        3,
        servers,
        fn,
        partition_bytes=partition_bytes,
        timeout=3.0,
        transport="shm",
    ):
        np.testing.assert_array_equal(got, 6 * x)
        assert took < 3.0
        assert all(p.segment_ids for p in pools)  # it went through shm


def test_slots_are_carved_when_taken_and_aligned():
    attached = []

    def attach(fd, size):
        attached.append(size)
        return len(attached)

    pool = shm.SlotPool(attach, 12, max_bytes=2 * shm.SEGMENT_BYTES)
    assert pool.slots_per_segment == shm.SEGMENT_BYTES // shm.SLOT_ALIGN
    slots = [pool.take(12) for _ in range(3)]
    assert [s.ref.offset for s in slots] == [0, 64, 128]
    assert all(len(s.memory) == 12 for s in slots)
    assert attached == [shm.SEGMENT_BYTES] and not pool._free
    for s in slots:  # the elements of every dtype are aligned
        assert s.array(np.float64, 1).flags.aligned
    assert pool.take(13) is None  # larger than a slot
    pool.give(slots[1])
    assert pool.take(4) is slots[1]  # a slot given back goes first
    # the rest of the segment, then a second one, then gRPC
    pool._left = 1
    assert pool.take(12).ref.offset == 192
    assert pool.take(12).ref == pb.ShmSlot(segment=2, offset=0)
    pool._left = 0
    assert pool.take(12) is None and len(attached) == 2
    pool.close()


def memfd(size=4096, seals=_wire.SHM_SEALS, allocate=True):
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if allocate:
        os.posix_fallocate(fd, 0, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def header_of(client, rank=0, key=1, length=2048):
    return pb.Header(
        version=_wire.PROTOCOL_VERSION,
        job_id="jaxps",
        rank=rank,
        key=key,
        round=0,
        dtype=pb.FLOAT32,
        length=length,
    )


@pytest.mark.timeout(60)
def test_attach_checks_seals_size_and_allocation(start_servers):
    (server,) = start_servers(1, 1)
    client = ServerClient(server.address, max_message_bytes=1 << 20, timeout=10)
    client.hello(job_id="jaxps", rank=0, num_workers=1)
    cases = [
        (memfd(seals=0), 4096, "not a memfd sealed against shrinking"),
        (memfd(), 8192, "has 4096 bytes, not the 8192"),
        (memfd(1 << 30, allocate=False), 1 << 30, "is sparse"),
    ]
    for fd, size, message in cases:
        with pytest.raises(errors.RequestRejectedError, match=message):
            client.attach(fd, size)
        os.close(fd)
    # an Attach whose descriptor never reached the server's socket
    request = pb.AttachRequest(
        header=client._header, size=4096, cookie=bytes(16)
    )
    with pytest.raises(errors.RequestRejectedError, match="names no segment"):
        client._call(
            client._attach, request, time.monotonic() + 10, None, "attach"
        )
    fd = memfd()
    segment = client.attach(fd, 4096)
    # sealed: nobody can shrink it under the server (the SIGBUS route)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    os.close(fd)
    header = header_of(client)
    deadline = time.monotonic() + 10
    with pytest.raises(errors.RequestRejectedError, match="outside its"):
        client.push(
            header,
            None,
            0,
            deadline,
            slot=pb.ShmSlot(segment=segment, offset=1),
        )
    with pytest.raises(errors.RequestRejectedError, match="never attached"):
        client.push(
            header,
            None,
            0,
            deadline,
            slot=pb.ShmSlot(segment=segment ^ 1, offset=0),
        )
    client.detach([segment])
    with pytest.raises(errors.RequestRejectedError, match="never attached"):
        client.push(
            header,
            None,
            0,
            deadline,
            slot=pb.ShmSlot(segment=segment, offset=0),
        )
    assert server.proc.poll() is None
    client.close()


@pytest.mark.timeout(60)
def test_a_foreign_slot_is_refused(start_servers):
    # Rank 1 (or anyone claiming it) names rank 0's segment: refused, and
    # rank 0's in-flight gradient is neither read nor changed.
    (server,) = start_servers(1, 2)
    clients = [
        ServerClient(server.address, max_message_bytes=1 << 20, timeout=10)
        for _ in range(2)
    ]
    for rank, c in enumerate(clients):
        c.hello(job_id="jaxps", rank=rank, num_workers=2)
    fd = memfd()
    segment = clients[0].attach(fd, 4096)
    os.close(fd)
    deadline = time.monotonic() + 10
    for rank in (1,):
        with pytest.raises(errors.RequestRejectedError, match="never attached"):
            clients[rank].push(
                header_of(clients[rank], rank=rank, length=16),
                None,
                0,
                deadline,
                slot=pb.ShmSlot(segment=segment, offset=0),
            )
    # an intruder's new init as rank 0 gets a job incarnation of its own
    intruder = ServerClient(
        server.address, max_message_bytes=1 << 20, timeout=10
    )
    intruder.hello(job_id="jaxps", rank=0, num_workers=2)
    assert intruder.session != clients[0].session
    with pytest.raises(errors.RequestRejectedError, match="never attached"):
        intruder.push(
            header_of(intruder, length=16),
            None,
            0,
            deadline,
            slot=pb.ShmSlot(segment=segment, offset=0),
        )
    for c in (*clients, intruder):
        c.close()


def test_segments_are_capped_per_rank_and_by_the_budget():
    from jaxps.servers import _store

    budget = _store.Budget(8192)
    segments = _shm.Segments(budget, max_rank_bytes=8192)
    fds = [memfd() for _ in range(3)]
    try:
        segments.attach(0, fds[0], 4096)
        segments.attach(0, fds[1], 4096)
        with pytest.raises(_wire.Rejected, match="8 MiB|0 MiB per rank"):
            segments.attach(0, fds[2], 4096)
        with pytest.raises(_wire.Rejected, match="--max-memory"):
            segments.attach(1, fds[2], 4096)  # the budget is full
        segments.close()
        assert budget.held == 0
    finally:
        for fd in fds:
            os.close(fd)


@contextlib.contextmanager
def two_workers(server, timeout=30.0, transport="shm"):
    """Runtimes of ranks 0 and 1 of a 2-worker job on `server`."""
    rt = [
        Runtime(
            Config(
                servers=(server.address,),
                num_workers=2,
                worker_rank=r,
                partition_bytes=PARTITION,
                timeout=timeout,
                transport=transport,
            )
        )
        for r in range(2)
    ]
    try:
        yield rt
    finally:
        for r in rt:
            r.close()


@pytest.mark.timeout(60)
def test_retried_push_from_a_slot_is_counted_once(start_servers):
    (server,) = start_servers(1, 2)
    with two_workers(server) as rt:
        x = np.full(100, 3.0, np.float32)
        transport = rt[0]._transports[0]
        slot = transport.pool.take(x.nbytes)
        np.copyto(slot.array(x.dtype, x.size), x)
        header = pb.Header(
            version=_wire.PROTOCOL_VERSION,
            job_id="jaxps",
            rank=0,
            key=5,
            round=0,
            dtype=pb.FLOAT32,
            length=x.size,
        )
        for _ in range(3):  # the same push, replayed
            soon = time.monotonic() + 10
            transport.client.push(header, None, 7, soon, slot=slot.ref)
        other = pb.Header()
        other.CopyFrom(header)
        other.rank = 1
        rt[1]._transports[0].client.push(
            other, x, _wire.fingerprint(x), time.monotonic() + 10
        )
        got = transport.client.pull(header, time.monotonic() + 10, slot.ref)
        assert got is None  # the sum is in the slot
        np.testing.assert_array_equal(slot.array(x.dtype, x.size), 2 * x)
        # a pull without a slot gets the same sum in the reply
        payload = rt[1]._transports[0].client.pull(other, time.monotonic() + 10)
        np.testing.assert_array_equal(np.frombuffer(payload, x.dtype), 2 * x)


@pytest.mark.timeout(60)
def test_replayed_push_pull_is_counted_once(start_servers):
    # PushPull (push from a slot and pull into it in one call) replayed
    # before and after the round completes, and after it was freed.
    (server,) = start_servers(1, 2)
    with two_workers(server) as rt:
        xs = [np.full(100, 3.0 * (r + 1), np.float32) for r in range(2)]
        transports = [r._transports[0] for r in rt]
        slots = [t.pool.take(x.nbytes) for t, x in zip(transports, xs)]
        headers = []
        for rank, (slot, x) in enumerate(zip(slots, xs)):
            np.copyto(slot.array(x.dtype, x.size), x)
            headers.append(
                pb.Header(
                    version=_wire.PROTOCOL_VERSION,
                    job_id="jaxps",
                    rank=rank,
                    key=5,
                    round=0,
                    dtype=pb.FLOAT32,
                    length=x.size,
                )
            )
        soon = time.monotonic() + 10
        # rank 0 waits for rank 1 (a future), which pushes twice
        waiting = transports[0].client.push_pull_future(
            headers[0], 7, soon, slots[0].ref
        )
        for _ in range(2):
            transports[1].client.push_pull(headers[1], 8, soon, slots[1].ref)
        transports[0].client.decode_pull(
            waiting.result(), headers[0], slots[0].ref
        )
        for slot in slots:
            np.testing.assert_array_equal(slot.array(np.float32, 100), 9.0)
        # the round is freed now; rank 0 replays (its reply "was lost")
        transports[0].client.push_pull(headers[0], 7, soon, slots[0].ref)
        np.testing.assert_array_equal(slots[0].array(np.float32, 100), 9.0)
        # a PushPull without a slot is refused, naming what is missing
        bad = pb.Header()
        bad.CopyFrom(headers[0])
        bad.round = 1
        client = transports[0].client
        request = _codec.encode_push(bad, np.ones(100, np.float32), 7)
        with pytest.raises(errors.RequestRejectedError, match="no shared-m"):
            client._call(client._push_pull, request, soon, bad, "push_pull")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "grpc", "tcp"])
def test_opposite_orders_do_not_deadlock(start_servers, transport):
    # A sender thread waits for its PushPull's (or Pull's) round only while
    # another sender thread stays free. Here each worker has 2 sender
    # threads and queues six one-chunk push_pulls in the other worker's
    # reverse order: if both threads waited, each worker would wait for
    # chunks the other has not sent.
    (server,) = start_servers(1, 2)
    with two_workers(server, timeout=5.0, transport=transport) as rt:
        assert all(len(r._sender.threads) == 2 for r in rt)
        names = [f"t{i}" for i in range(6)]
        x = np.arange(1000, dtype=np.float32)
        handles = [
            [
                r.push_pull_async([n], [x * (rank + 1)], average=False)
                for n in (names if rank == 0 else names[::-1])
            ]
            for rank, r in enumerate(rt)
        ]
        for per_rank in handles:
            for handle in per_rank:
                np.testing.assert_array_equal(handle.wait(20)[0], 3 * x)


def test_codec_rejects_a_slot_that_is_not_a_message():
    raw = _codec.encode_push(pb.Header(version=1), b"", 0)
    with pytest.raises(_codec.DecodeError, match="slot"):
        _codec.decode_push(raw + bytes([4 << 3 | 0, 1]))


def count_grpc_push_pulls(monkeypatch) -> list[int]:
    """Counts the shared-memory PushPull calls over gRPC (they still run)."""
    calls = [0]
    for method in ("push_pull", "push_pull_future"):
        real = getattr(ServerClient, method)

        def counted(self, *args, _real=real, **kwargs):
            calls[0] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(ServerClient, method, counted)
    return calls


@pytest.mark.timeout(60)
def test_slots_are_named_on_the_data_channel(start_servers, monkeypatch):
    # With "auto", a chunk in a slot is one data-channel request naming the
    # slot, not a gRPC PushPull; its sum comes back in the slot.
    monkeypatch.setattr(shm, "SMALL_BYTES", 0)  # every chunk in a slot
    grpc_calls = count_grpc_push_pulls(monkeypatch)
    servers = start_servers(2, 2)
    x = np.arange(5 * PARTITION // 4 + 3, dtype=np.float32)

    def fn(rt):
        sums = [rt.push_pull(f"t{i}", x * (rt.rank + 1)) for i in range(3)]
        # a call check carried in a slot still names a mismatch at once
        other = np.ones(PARTITION // 4 * (2 + rt.rank), np.float32)
        handle = rt.push_pull_async(["m"], [other], call="m")
        began = time.monotonic()
        with pytest.raises(errors.MismatchError):
            handle.wait(10)
        sums.append(time.monotonic() - began)
        used = [
            (len(t.pool.segment_ids), t.small.connection is not None)
            for t in (t.current for t in rt._transports)
        ]
        return sums, used

    for sums, used in run_workers(
        2, servers, fn, partition_bytes=PARTITION, transport="auto"
    ):
        for got in sums[:3]:
            np.testing.assert_array_equal(got, 1.5 * x)
        assert sums[3] < 2.0
        # both servers' slots, their data channels still up
        assert used == [(1, True), (1, True)], used
    assert grpc_calls[0] == 0


class _Replies:
    """`_wire.DATA_REPLY` that records the kind of every frame a worker
    reads."""

    def __init__(self, real):
        self.real, self.size, self.kinds = real, real.size, []

    def pack(self, *fields):
        return self.real.pack(*fields)

    def unpack(self, head):
        fields = self.real.unpack(head)
        self.kinds.append(fields[0])
        return fields


@pytest.mark.timeout(60)
def test_a_sum_ready_at_once_in_a_slot_is_its_own_acknowledgement(
    start_servers, monkeypatch
):
    # Rank 0's chunk waits for rank 1: acknowledged, then summed. Rank 1's
    # completes the round: its sum, in its slot, has no bytes to wait for
    # and is the only answer.
    monkeypatch.setattr(shm, "SMALL_BYTES", 0)
    replies = _Replies(_wire.DATA_REPLY)
    monkeypatch.setattr(_wire, "DATA_REPLY", replies)
    (server,) = start_servers(1, 2)
    x = np.arange(PARTITION // 4, dtype=np.float32)
    with two_workers(server, transport="auto") as rt:
        del replies.kinds[:]
        first = rt[0].push_pull_async(["w"], [x], average=False)
        deadline = time.monotonic() + 10
        while _wire.DATA_ACK not in replies.kinds:
            assert time.monotonic() < deadline, replies.kinds
            time.sleep(0.01)
        second = rt[1].push_pull_async(["w"], [2 * x], average=False)
        for handle in (first, second):
            np.testing.assert_array_equal(handle.wait(20)[0], 3 * x)
    assert sorted(replies.kinds) == [_wire.DATA_ACK, *[_wire.DATA_SUM] * 2]


@pytest.mark.timeout(60)
def test_a_slot_whose_data_channel_is_lost_goes_over_grpc_once(
    start_servers, monkeypatch
):
    # Rank 0's chunk waits in the server for rank 1 when its data
    # connection breaks: it is sent again as a gRPC PushPull naming the
    # same slot, which the server counts once.
    monkeypatch.setattr(shm, "SMALL_BYTES", 0)
    grpc_calls = count_grpc_push_pulls(monkeypatch)
    (server,) = start_servers(1, 2)
    x = np.arange(PARTITION // 4, dtype=np.float32)
    with two_workers(server, timeout=10.0, transport="auto") as rt:
        first = rt[0].push_pull_async(["w"], [x], average=False)
        conn = rt[0]._transports[0].current.small.connection
        deadline = time.monotonic() + 10
        while not conn._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert conn._pending, "rank 0's chunk was not sent in its slot"
        conn.sock.shutdown(socket.SHUT_RDWR)  # the link breaks
        while grpc_calls[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # its PushPull over gRPC waits for rank 1
        second = rt[1].push_pull_async(["w"], [2 * x], average=False)
        np.testing.assert_array_equal(first.wait(20)[0], 3 * x)
        np.testing.assert_array_equal(second.wait(20)[0], 3 * x)
        assert grpc_calls[0] == 1
        # the next round: counted once, not twice
        again = [
            r.push_pull_async(["w"], [x * (i + 1)], average=False)
            for i, r in enumerate(rt)
        ]
        for handle in again:
            np.testing.assert_array_equal(handle.wait(20)[0], 3 * x)
