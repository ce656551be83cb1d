"""The data channel on real networks: TLS, a fixed port, a blocked port, a
full file table and a flood of idle connections, against real servers."""

import concurrent.futures
import contextlib
import os
import resource
import socket
import ssl
import threading
import time

import numpy as np
import pytest

from jaxps._src.config import Config
from jaxps._src.runtime import Runtime
from jaxps._src.transport import data as transport_data
from jaxps._src.transport import shm
from jaxps.servers import _wire


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(server, n=2, **kw):
    """`n` in-process workers of one job on `server`, over the data
    channel; the caller closes them."""
    kw = {"transport": "tcp", "partition_bytes": 1 << 20, "timeout": 20.0, **kw}

    def start(rank):
        return Runtime(
            Config(
                servers=(server.address,),
                num_workers=n,
                worker_rank=rank,
                **kw,
            )
        )

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(start, range(n)))


def sum_exactly(runtimes, name="w", size=3_000_000):
    """A push_pull of 12 MB (12 chunks) on every rank; asserts the sum."""
    x = np.arange(size, dtype=np.float32) % 1000
    handles = [
        rt.push_pull_async([name], [x * (r + 1)], average=False)
        for r, rt in enumerate(runtimes)
    ]
    total = sum(range(1, len(runtimes) + 1))
    for handle in handles:
        np.testing.assert_array_equal(handle.wait(60)[0], total * x)


def connections(runtimes):
    return [t.connection for rt in runtimes for t in rt._transports]


def close(runtimes):
    for rt in runtimes:
        rt.close()


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError(f"no thread count for pid {pid}")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_tls_keeps_the_data_channel(start_servers, certificate, mutual):
    cert, key = certificate
    flags = ["--tls-cert", cert, "--tls-key", key]
    client = {"tls_ca": cert}
    if mutual:  # the same self-signed pair signs the client
        flags += ["--tls-client-ca", cert]
        client.update(tls_cert=cert, tls_key=key)
    (server,) = start_servers(1, 2, *flags)
    runtimes = job(server, **client)
    try:
        assert all(
            c is not None and isinstance(c.sock, ssl.SSLSocket)
            for c in connections(runtimes)
        )
        sum_exactly(runtimes)
        # a fused piece of more tensors than one sendmsg takes: on TLS its
        # parts are joined into one record
        count = _wire.SEND_VECTORS + 100
        names = [f"s{i}" for i in range(count)]
        handles = [
            rt.push_pull_async(
                names,
                [np.full(3, float(i + r), np.float32) for i in range(count)],
                average=False,
            )
            for r, rt in enumerate(runtimes)
        ]
        for handle in handles:
            for i, out in enumerate(handle.wait(30)):
                np.testing.assert_array_equal(out, 2.0 * i + 1)
        # every chunk went over the TLS data channel, none fell back
        assert all(c is not None for c in connections(runtimes))
    finally:
        close(runtimes)


@pytest.mark.timeout(60)
def test_slots_are_named_on_a_tls_data_channel(
    start_servers, certificate, monkeypatch
):
    # A TLS server on this host: the payloads stay in shared memory and
    # the requests that name their slots go on the TLS data channel.
    monkeypatch.setattr(shm, "SMALL_BYTES", 0)
    cert, key = certificate
    (server,) = start_servers(1, 2, "--tls-cert", cert, "--tls-key", key)
    runtimes = job(server, tls_ca=cert, transport="auto")
    try:
        sum_exactly(runtimes)
        for rt in runtimes:
            (transport,) = [t.current for t in rt._transports]
            conn = transport.small.connection  # still up: none fell back
            assert conn is not None and isinstance(conn.sock, ssl.SSLSocket)
            assert transport.pool.segment_ids  # the payloads went in slots
    finally:
        close(runtimes)


@pytest.mark.timeout(60)
def test_mutual_tls_data_channel_refuses_a_client_without_a_certificate(
    start_servers, certificate
):
    cert, key = certificate
    port = free_port()
    start_servers(
        1, 1, "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", cert,
        "--data-port", str(port),
    )  # fmt: skip
    context = ssl.create_default_context(cafile=cert)
    raw = socket.create_connection(("127.0.0.1", port), 5)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            sock.sendall(bytes(_wire.DATA_HELLO.size))
            if not sock.recv(1):  # TLS 1.3 tells it on the first read
                raise ConnectionError("closed without a reply")


@pytest.mark.timeout(60)
def test_fixed_data_port(start_servers):
    port = free_port()
    (server,) = start_servers(1, 2, "--data-port", str(port))
    runtimes = job(server)
    try:
        assert {c.port for c in connections(runtimes)} == {port}
        sum_exactly(runtimes)
    finally:
        close(runtimes)
    # a second server cannot take the same data port: named at start
    with pytest.raises(RuntimeError, match=f"port {port}"):
        start_servers(1, 2, "--data-port", str(port))


@pytest.mark.timeout(60)
def test_a_lost_data_channel_is_opened_again(start_servers, monkeypatch):
    monkeypatch.setattr(transport_data, "RETRY_FIRST", 0.5)
    (server,) = start_servers(1, 2)
    runtimes = job(server)
    try:
        sum_exactly(runtimes, "a")
        for conn in connections(runtimes):
            conn.sock.shutdown(socket.SHUT_RDWR)  # the link breaks
        sum_exactly(runtimes, "b")  # over gRPC while it is down
        deadline = time.monotonic() + 20
        while not all(connections(runtimes)):
            assert time.monotonic() < deadline, "not opened again"
            sum_exactly(runtimes, "c", 1000)  # a send looks at the retry
            time.sleep(0.2)
        sum_exactly(runtimes, "d")
        assert all(connections(runtimes))
    finally:
        close(runtimes)


@pytest.mark.timeout(90)
def test_accept_survives_a_full_file_table(start_servers):
    port = free_port()
    (server,) = start_servers(1, 2, "--data-port", str(port))
    pid = server.proc.pid
    hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]
    limit = len(os.listdir(f"/proc/{pid}/fd")) + 16
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, hard))
    flood = []
    try:
        for _ in range(limit + 64):  # more than the table holds
            with contextlib.suppress(OSError):
                flood.append(socket.create_connection(("127.0.0.1", port), 2))
        deadline = time.monotonic() + 10
        while "Too many open files" not in server.child.stderr_tail():
            assert time.monotonic() < deadline, server.child.stderr_tail()
            time.sleep(0.05)
    finally:
        for sock in flood:
            sock.close()
    assert server.proc.poll() is None
    runtimes = job(server)  # the next job: the channel still accepts
    try:
        assert all(connections(runtimes))
        sum_exactly(runtimes)
    finally:
        close(runtimes)


@pytest.mark.timeout(120)
def test_idle_connection_flood_is_capped(start_servers):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        pytest.skip(f"the open-file limit {hard} is under 1,200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    port = free_port()
    (server,) = start_servers(1, 2, "--data-port", str(port))
    pid = server.proc.pid
    before = threads_of(pid)
    flood = []
    try:
        for _ in range(1000):
            with contextlib.suppress(OSError):
                flood.append(socket.create_connection(("127.0.0.1", port), 2))
        assert len(flood) > 500
        # at most MAX_UNAUTHENTICATED of them hold a thread, the rest are
        # closed at once; a job still sums exactly (over gRPC where its
        # data connection was refused)
        assert threads_of(pid) <= before + 128 + 8
        runtimes = job(server)
        try:
            sum_exactly(runtimes)
            assert threads_of(pid) <= before + 128 + 16
        finally:
            close(runtimes)
    finally:
        for sock in flood:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert server.proc.poll() is None


class _GrpcOnlyService:
    """A Service that forwards only the gRPC port: 127.0.0.2:<port> to the
    server, while 127.0.0.2:<data port> drops every connection attempt (a
    listener with a full queue that never accepts: SYNs go unanswered, as
    behind a firewall)."""

    def __init__(self, server_address: str, data_port: int):
        self.target = server_address.rpartition(":")
        self.listener = socket.create_server(("127.0.0.2", 0))
        self.address = f"127.0.0.2:{self.listener.getsockname()[1]}"
        self.dropper = socket.create_server(("127.0.0.2", data_port), backlog=0)
        self.queued = []
        for _ in range(4):  # fill the queue; later SYNs are dropped
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.2", data_port))
            self.queued.append(s)
        self.sockets = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                a, _ = self.listener.accept()
                b = socket.create_connection(
                    (self.target[0], int(self.target[2]))
                )
            except OSError:
                return
            self.sockets += [a, b]
            for x, y in ((a, b), (b, a)):
                threading.Thread(
                    target=self._pump, args=(x, y), daemon=True
                ).start()

    @staticmethod
    def _pump(x, y):
        with contextlib.suppress(OSError):
            while data := x.recv(1 << 16):
                y.sendall(data)
        with contextlib.suppress(OSError):
            y.shutdown(socket.SHUT_WR)

    def close(self):
        for s in [self.listener, self.dropper, *self.queued, *self.sockets]:
            s.close()


@pytest.mark.timeout(60)
def test_blocked_data_port_falls_back_to_grpc_within_3_s(start_servers, caplog):
    """Only the gRPC port gets through (a Service or firewall without the
    data port, whose packets are dropped): init answers over gRPC in under
    3 s with one warning naming the port, and the sums are exact."""
    data_port = free_port()
    (server,) = start_servers(1, 1, "--data-port", str(data_port))
    service = _GrpcOnlyService(server.address, data_port)
    try:
        start = time.monotonic()
        (rt,) = job(service, n=1)
        took = time.monotonic() - start
        try:
            assert took < 3.0, took
            assert connections([rt]) == [None]  # payloads go over gRPC
            sum_exactly([rt])
        finally:
            rt.close()
    finally:
        service.close()
    warnings = [
        r.getMessage() for r in caplog.records if r.levelname == "WARNING"
    ]
    assert any(f"Open TCP port {data_port}" in w for w in warnings), warnings


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_hello_that_trickles_is_cut_at_the_deadline(start_servers):
    """One byte a second never makes a hello: the server closes the
    connection once its 5 s are up, however slowly the bytes come."""
    port = free_port()
    start_servers(1, 1, "--data-port", str(port))
    sock = socket.create_connection(("127.0.0.1", port), 5)
    start = time.monotonic()
    try:
        with pytest.raises((ConnectionError, BrokenPipeError)):
            while time.monotonic() - start < 20:
                sock.sendall(b"\0")
                time.sleep(1.0)
                sock.setblocking(False)
                try:
                    if sock.recv(1 << 16) == b"":
                        raise ConnectionError("closed by the server")
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
        assert time.monotonic() - start < 8
    finally:
        sock.close()
