"""The data channel of a live server: handshake, auth and hostile frames."""

import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxps.servers import _wire
from jaxps.servers import jaxps_pb2 as pb

TOKEN = "s3cret-token"


def hello(address, rank=0, num_workers=2, token=None):
    """Says Hello over gRPC; returns the HelloReply."""
    metadata = ((_wire.TOKEN_KEY, token),) if token else None
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            f"/{_wire.SERVICE_NAME}/Hello",
            request_serializer=pb.HelloRequest.SerializeToString,
            response_deserializer=pb.HelloReply.FromString,
        )
        return call(
            pb.HelloRequest(
                version=_wire.PROTOCOL_VERSION,
                job_id="jaxps",
                rank=rank,
                num_workers=num_workers,
            ),
            timeout=10,
            metadata=metadata,
        )


def recv_exact(sock, n):
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise ConnectionError("closed")
        out += part
    return bytes(out)


def read_frame(sock):
    """(kind, status name, request id, body) of the next server frame."""
    kind, status, _, rid, size = _wire.DATA_REPLY.unpack(
        recv_exact(sock, _wire.DATA_REPLY.size)
    )
    return kind, _wire.STATUS_CODES[status], rid, recv_exact(sock, size)


def connect(address, reply, rank=0, token=None, nonce=None, mac=None):
    """Opens a data connection and sends its hello; returns the socket."""
    host = address.rpartition(":")[0]
    sock = socket.create_connection((host, reply.data_port), timeout=10)
    nonce = reply.data_nonce if nonce is None else nonce
    if mac is None:
        mac = _wire.data_mac(token, nonce, rank, "jaxps")
    sock.sendall(
        _wire.DATA_HELLO.pack(
            _wire.DATA_MAGIC, _wire.PROTOCOL_VERSION, rank, nonce, mac
        )
    )
    return sock


def request(
    rank=0,
    key=7,
    rnd=0,
    dtype=1,
    length=4,
    rid=1,
    name=b"t[0]",
    checksum=0,
    op=_wire.DATA_OP_PUSH_PULL,
):
    head = _wire.DATA_REQUEST.pack(
        op,
        dtype,
        len(name),
        rank,
        key,
        rnd,
        length,
        checksum,
        rid,
        5.0,
    )
    return head + name


def test_server_offers_a_data_channel(start_servers):
    (server,) = start_servers(1, 1)
    reply = hello(server.address, num_workers=1)
    assert reply.data_port > 0 and len(reply.data_nonce) == 16
    with connect(server.address, reply) as sock:
        kind, _, _, body = read_frame(sock)
        assert kind == _wire.DATA_OK
        assert body.decode() == reply.incarnation
        x = np.arange(4, dtype=np.float32)
        sock.sendall(request(checksum=_wire.fingerprint(x)) + x.tobytes())
        # acknowledged before the sum, even when the sum is ready at once:
        # the credit must not wait for the sum's bytes on a slow link
        kinds = [read_frame(sock) for _ in range(2)]
    assert [k[:3] for k in kinds] == [
        (_wire.DATA_ACK, "OK", 1),
        (_wire.DATA_SUM, "OK", 1),
    ]
    np.testing.assert_array_equal(np.frombuffer(kinds[1][3], np.float32), x)


def test_answers_stay_whole_and_in_order_while_the_worker_reads_slowly(
    start_servers,
):
    """Sums far larger than the socket's buffer, and errors between them,
    while the worker reads slowly: the event loop sends an answer itself
    only while the writer has none queued, and the rest of one it began
    before any other."""
    (server,) = start_servers(1, 1)
    reply = hello(server.address, num_workers=1)
    n = 1 << 19  # 2 MiB of float32 per sum
    pushes = [np.full(n, i + 1.0, np.float32) for i in range(12)]
    wrong = {2, 5, 9}  # pushes whose checksum is wrong
    answers = []

    def read_slowly(sock):
        def recv(size):
            out = bytearray()
            while len(out) < size:
                part = sock.recv(min(size - len(out), 256 * 1024))
                if not part:
                    raise ConnectionError("closed")
                out += part
                time.sleep(0.002)
            return bytes(out)

        done = 0
        while done < len(pushes):
            kind, status, _, rid, size = _wire.DATA_REPLY.unpack(
                recv(_wire.DATA_REPLY.size)
            )
            answers.append((kind, _wire.STATUS_CODES[status], rid, recv(size)))
            done += kind != _wire.DATA_ACK

    with connect(server.address, reply) as sock:
        assert read_frame(sock)[0] == _wire.DATA_OK
        reader = threading.Thread(target=read_slowly, args=(sock,))
        reader.start()
        for i, x in enumerate(pushes):
            checksum = _wire.fingerprint(x) ^ (i in wrong)
            sock.sendall(
                request(key=30 + i, length=n, rid=100 + i, checksum=checksum)
                + x.tobytes()
            )
            time.sleep(0.005)
        reader.join(timeout=60)
    assert not reader.is_alive()
    acks = [a[2] for a in answers if a[0] == _wire.DATA_ACK]
    answers = [a for a in answers if a[0] != _wire.DATA_ACK]
    assert acks == [100 + i for i in range(len(pushes)) if i not in wrong]
    assert [a[:3] for a in answers] == [
        (_wire.DATA_ERROR, "INVALID_ARGUMENT", 100 + i)
        if i in wrong
        else (_wire.DATA_SUM, "OK", 100 + i)
        for i in range(len(pushes))
    ]
    for i, answer in enumerate(answers):
        if i in wrong:
            assert b"checksum" in answer[3]
        else:
            np.testing.assert_array_equal(
                np.frombuffer(answer[3], np.float32), pushes[i]
            )


def test_nonce_is_used_once_and_bound_to_its_rank(start_servers):
    (server,) = start_servers(1, 2)
    reply = hello(server.address, rank=0)
    with connect(server.address, reply, rank=1) as sock:  # not rank 1's
        kind, status, _, body = read_frame(sock)
    assert (kind, status) == (_wire.DATA_ERROR, "FAILED_PRECONDITION")
    assert b"no valid nonce" in body
    reply = hello(server.address, rank=0)
    with connect(server.address, reply) as sock:
        assert read_frame(sock)[0] == _wire.DATA_OK
    with connect(server.address, reply) as sock:  # the same nonce again
        kind, status, _, _ = read_frame(sock)
    assert (kind, status) == (_wire.DATA_ERROR, "FAILED_PRECONDITION")


def test_data_channel_needs_the_token(start_servers):
    (server,) = start_servers(1, 2, "--token", TOKEN)
    reply = hello(server.address, token=TOKEN)
    with connect(server.address, reply, token="wrong") as sock:
        kind, status, _, body = read_frame(sock)
    assert (kind, status) == (_wire.DATA_ERROR, "UNAUTHENTICATED")
    assert b"token" in body
    reply = hello(server.address, token=TOKEN)
    with connect(server.address, reply, token=TOKEN) as sock:
        assert read_frame(sock)[0] == _wire.DATA_OK


def test_oversized_payload_is_refused_before_it_is_read(start_servers):
    (server,) = start_servers(1, 1, "--max-message-bytes", "1000000")
    reply = hello(server.address, num_workers=1)
    with connect(server.address, reply) as sock:
        read_frame(sock)
        sock.sendall(request(length=2**40))
        kind, status, _, body = read_frame(sock)
    assert (kind, status) == (_wire.DATA_ERROR, "RESOURCE_EXHAUSTED")
    assert b"at most 1000000" in body


@pytest.mark.timeout(120)
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.data())
def test_server_survives_malformed_frames(module_server, data):
    server = module_server
    reply = hello(server.address, rank=1)
    kind = data.draw(
        st.sampled_from(
            [
                "random",
                "op",
                "rank",
                "dtype",
                "length",
                "huge",
                "check",
                "carried",
                "slot",
            ]
        )
    )
    valid = {*_wire.DATA_OPS} | {
        op | _wire.DATA_OP_IN_SLOT
        for op in _wire.DATA_OPS
        if op != _wire.DATA_OP_CHECK
    }
    key = data.draw(st.integers(100, 2**40))
    if kind == "random":
        frame = data.draw(st.binary(max_size=200))
    elif kind == "op":
        op = data.draw(st.integers(0, 255).filter(lambda o: o not in valid))
        frame = bytes([op]) + request(rank=1, key=key)[1:]
    elif kind == "slot":  # a slot of memory this rank never attached
        frame = request(
            rank=1,
            key=key,
            length=data.draw(st.integers(0, 2**20)),
            op=data.draw(
                st.sampled_from(
                    [_wire.DATA_OP_PUSH_PULL, _wire.DATA_OP_PUSH_PULL_CHECKED]
                )
            )
            | _wire.DATA_OP_IN_SLOT,
        ) + _wire.DATA_SLOT.pack(
            data.draw(st.integers(0, 2**32 - 1)),
            data.draw(st.integers(0, 2**64 - 1)),
        )
    elif kind == "rank":
        frame = request(rank=data.draw(st.sampled_from([0, 2, 2**31])))
    elif kind == "dtype":
        dtype = data.draw(st.integers(7, 255))
        frame = request(rank=1, key=key, dtype=dtype, length=1) + b"\0"
    elif kind == "length":
        frame = request(rank=1, key=key, length=0)
    elif kind in ("check", "carried"):  # a name field of any bytes
        x = np.ones(1, np.float32)
        frame = (
            request(
                rank=1,
                key=key,
                length=1,
                name=data.draw(st.binary(max_size=300)),
                checksum=_wire.fingerprint(x),
                op=_wire.DATA_OP_CHECK
                if kind == "check"
                else _wire.DATA_OP_PUSH_PULL_CHECKED,
            )
            + x.tobytes()
        )
    else:
        frame = request(
            rank=1, key=key, length=data.draw(st.integers(2**30, 2**63))
        )
    with connect(server.address, reply, rank=1) as sock:
        assert read_frame(sock)[0] == _wire.DATA_OK
        try:
            sock.sendall(frame)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server closed it already, after its answer
        try:
            answer = read_frame(sock)
        except (ConnectionError, OSError, struct.error):
            answer = None  # closed: fine for a stream it cannot parse
    if kind == "check":  # accepted (it waits for rank 0's push)
        assert answer is not None and answer[0] == _wire.DATA_ACK, answer
    if kind == "carried":  # accepted, or refused: too short, or a mismatch
        assert answer is not None, answer
        assert answer[0] == _wire.DATA_ACK or answer[:2] == (
            _wire.DATA_ERROR,
            "INVALID_ARGUMENT",
        ), answer
    if kind in ("op", "rank", "dtype", "length", "huge"):
        assert answer is not None and answer[0] == _wire.DATA_ERROR, answer
        assert answer[1] in (
            "INVALID_ARGUMENT",
            "RESOURCE_EXHAUSTED",
        ), answer
    if kind == "slot":  # refused, never read or written
        assert answer is not None and answer[0] == _wire.DATA_ERROR, answer
        assert answer[1] in (
            "FAILED_PRECONDITION",
            "INVALID_ARGUMENT",
        ), answer
    assert server.proc.poll() is None
    # and it still serves a well-formed hello
    assert hello(server.address, rank=0).data_port == reply.data_port


def test_workers_sum_over_the_data_channel_with_a_token(start_servers):
    from jaxps._src.config import Config
    from jaxps._src.runtime import Runtime
    from jaxps._src.transport.data import DataTransport

    (server,) = start_servers(1, 2, "--token", TOKEN)
    runtimes = [
        Runtime(
            Config(
                servers=(server.address,),
                num_workers=2,
                worker_rank=r,
                token=TOKEN,
                transport="tcp",
                partition_bytes=4096,
            )
        )
        for r in range(2)
    ]
    try:
        assert all(
            isinstance(t.current, DataTransport) and t.connection is not None
            for rt in runtimes
            for t in rt._transports
        )
        x = np.arange(10_000, dtype=np.float32)
        handles = [
            rt.push_pull_async(["w"], [x * (r + 1)], average=False)
            for r, rt in enumerate(runtimes)
        ]
        for handle in handles:
            np.testing.assert_array_equal(handle.wait(30)[0], 3 * x)
        # every chunk went over the data channel, none fell back to gRPC
        assert all(
            t.connection is not None for rt in runtimes for t in rt._transports
        )
    finally:
        for rt in runtimes:
            rt.close()


def test_check_names_round_trip():
    raw = _wire.encode_check_name(2**64 - 1, "grads@0", "['w'] float32[3]")
    assert _wire.decode_check_name(raw) == (
        2**64 - 1,
        "grads@0",
        "['w'] float32[3]",
    )
    assert _wire.decode_check_name(b"abc") == (0, "abc", "")
    long = _wire.encode_check_name(1, "c", "x" * 100_000)
    assert len(long) < _wire.DATA_MAX_TEXT


def test_carrier_names_round_trip_whatever_their_text():
    from jaxps.servers import jaxps_pb2 as pb

    sent = pb.Header(
        name="\0tune:probe[0]",  # the tuning probes' names start with NUL
        signature=2**64 - 1,
        description="['w'] float32[3]\0x",
        check_key=2**63,
        check_round=7,
        check_call="\0tune:probe@0",
    )
    got = pb.Header()
    _wire.decode_carrier_name(_wire.encode_carrier_name(sent), got)
    assert got == sent
    sent.description = "x" * 100_000  # cut, never the head
    raw = _wire.encode_carrier_name(sent)
    assert len(raw) < _wire.DATA_MAX_TEXT
    _wire.decode_carrier_name(raw, got)
    assert (got.name, got.check_call) == (sent.name, sent.check_call)
    with pytest.raises(_wire.Rejected, match="carried call check"):
        _wire.decode_carrier_name(raw[:10], got)
