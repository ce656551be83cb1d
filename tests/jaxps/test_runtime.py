"""The worker runtime against real server processes on loopback.

Each worker is a thread with its own `Runtime` (own channels and threads);
the servers are separate `jaxps-server` processes.
"""

import concurrent.futures
import time

import numpy as np
import pytest

from jaxps import errors
from jaxps._src import plan
from jaxps._src import runtime as runtime_module
from jaxps._src.config import Config
from jaxps._src.errors import MismatchError
from jaxps._src.runtime import Runtime
from jaxps._src.transport.grpc import GrpcTransport
from jaxps._src.transport.shm import ShmTransport
from jaxps.servers import _wire

SMALL = 4096  # partition bytes that make several chunks out of small arrays


def run_workers(n, servers, fn, **config):
    """Runs ``fn(runtime)`` on n workers at once; returns their results."""
    addresses = tuple(s.address for s in servers)
    config = {key: v for key, v in config.items() if v is not None}

    def work(rank):
        cfg = Config(
            servers=addresses, num_workers=n, worker_rank=rank, **config
        )
        runtime = Runtime(cfg)
        try:
            return fn(runtime)
        finally:
            runtime.close()

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(work, r) for r in range(n)]
        return [f.result(timeout=120) for f in futures]


def contribution(rank, size, dtype, seed=0):
    rng = np.random.default_rng(seed + 1000 * rank)
    return rng.integers(-100, 100, size=size).astype(dtype)


DTYPES = _wire.supported_dtypes()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "n,k,transport",
    [
        (1, 1, None),
        (2, 2, None),
        (4, 3, None),
        (2, 1, "grpc"),
        (4, 2, "grpc"),
        (2, 1, "tcp"),
        (4, 2, "tcp"),
    ],
    ids=["1-1", "2-2", "4-3", "2-1-grpc", "4-2-grpc", "2-1-tcp", "4-2-tcp"],
)
def test_sums_equal_numpy_for_all_dtypes_and_sizes(
    start_servers, n, k, transport
):
    # servers on 127.0.0.1 get payloads through shared memory unless
    # shm_bytes=0, which sends them in the gRPC messages
    servers = start_servers(k, n)
    # 1 element, not a multiple of the chunk size, several chunks
    sizes = [1, 1000, 3 * SMALL // 4 + 5, 10 * SMALL]

    def fn(rt):
        out = {}
        for dtype in DTYPES:
            for size in sizes:
                name = f"{np.dtype(dtype).name}/{size}"
                x = contribution(rt.rank, size, dtype)
                out[name] = rt.push_pull(name, x, average=False)
        return out

    results = run_workers(
        n, servers, fn, partition_bytes=SMALL, transport=transport
    )
    for dtype in DTYPES:
        for size in sizes:
            name = f"{np.dtype(dtype).name}/{size}"
            expected = sum(
                contribution(r, size, np.float64) for r in range(n)
            ).astype(dtype)
            for res in results:
                got = res[name]
                assert got.dtype == np.dtype(dtype), name
                assert got.shape == (size,)
                np.testing.assert_array_equal(got, expected, err_msg=name)


@pytest.mark.timeout(120)
def test_average_many_tensors_and_twenty_rounds(start_servers):
    n = 2
    servers = start_servers(2, n)
    shapes = [(3, 5), (7,), (2, 3, 4), (), (1000,)]

    def fn(rt):
        history = []
        for step in range(20):
            arrays = [np.full(s, rt.rank + step, np.float32) for s in shapes]
            names = [f"layer{i}" for i in range(len(shapes))]
            history.append(rt.push_pull_async(names, arrays).wait())
        return history

    for history in run_workers(n, servers, fn, partition_bytes=1024):
        for step, outs in enumerate(history):
            for out, shape in zip(outs, shapes):
                assert out.shape == shape
                np.testing.assert_allclose(out, step + 0.5)


@pytest.mark.timeout(120)
def test_credit_smaller_than_a_tensor(start_servers):
    servers = start_servers(1, 2)

    def fn(rt):
        return rt.push_pull("x", np.ones(50_000, np.float32), average=False)

    for out in run_workers(
        2, servers, fn, partition_bytes=8192, credit_bytes=8192
    ):
        np.testing.assert_array_equal(out, 2)


@pytest.mark.timeout(60)
def test_missing_worker_times_out_naming_its_rank(start_servers):
    servers = start_servers(1, 3, "--round-timeout", "2")
    cfg = Config(
        servers=(servers[0].address,), num_workers=3, worker_rank=1, timeout=2.0
    )
    rt = Runtime(cfg)
    try:
        with pytest.raises(
            errors.RoundTimeoutError, match=r"rank\(s\) \[0, 2\]"
        ):
            rt.push_pull("lonely", np.ones(10, np.float32))
    finally:
        rt.close()


@pytest.mark.timeout(60)
def test_mismatched_length_across_workers_is_rejected(start_servers):
    servers = start_servers(1, 2)

    def fn(rt):
        began = time.monotonic()
        try:
            rt.push_pull("w", np.ones(4 + rt.rank, np.float32))
        except MismatchError as err:  # the call check, at once
            return str(err), time.monotonic() - began
        return None

    results = run_workers(2, servers, fn, timeout=5.0)
    for message, seconds in results:
        assert seconds < 2.0, (seconds, message)
        assert "pushed [w float32[4]]" in message, message
        assert "pushed [w float32[5]]" in message, message


@pytest.mark.timeout(60)
def test_an_explicit_call_name_is_checked(start_servers):
    # `call=` names the call: ranks with other tensor names under one call
    # are told at once too
    servers = start_servers(1, 2)

    def fn(rt):
        try:
            rt.push_pull_async(
                [f"w{rt.rank}"], [np.ones(4 + rt.rank, np.float32)], call="c"
            ).wait()
        except MismatchError as err:
            return str(err)
        return None

    for message in run_workers(2, servers, fn, timeout=5.0):
        assert "push_pull 'c'" in message, message
        assert "rank 0 pushed" in message and "rank 1 pushed" in message


@pytest.mark.timeout(60)
def test_bad_hello(start_servers):
    servers = start_servers(1, 2, "--job-id", "jobA")
    address = (servers[0].address,)
    with pytest.raises(errors.RequestRejectedError, match="wrong num_workers"):
        Runtime(
            Config(servers=address, num_workers=3, worker_rank=0, job_id="jobA")
        )
    with pytest.raises(errors.RequestRejectedError, match="unknown job_id"):
        Runtime(
            Config(servers=address, num_workers=2, worker_rank=0, job_id="jobB")
        )


@pytest.mark.timeout(60)
def test_unreachable_server_is_named():
    cfg = Config(servers=("127.0.0.1:1",), num_workers=1, timeout=1.0)
    with pytest.raises(errors.ServerUnavailableError, match="127.0.0.1:1"):
        Runtime(cfg)


def test_local_bad_inputs():
    rt = Runtime(Config())
    with pytest.raises(TypeError, match="cannot send dtype complex64"):
        rt.push_pull("c", np.ones(2, np.complex64))
    with pytest.raises(TypeError, match="average=True needs a floating"):
        rt.push_pull("i", np.ones(2, np.int32))
    empty = rt.push_pull("e", np.ones((0, 3), np.float32))
    assert (empty.shape, empty.dtype) == ((0, 3), np.float32)
    with pytest.raises(ValueError, match="names must be unique"):
        rt.push_pull_async(["a", "a"], [np.ones(1), np.ones(1)])
    with pytest.raises(ValueError, match="got 1 priorities for 2 arrays"):
        rt.push_pull_async(["a", "b"], [np.ones(1), np.ones(1)], priorities=[1])
    np.testing.assert_array_equal(
        rt.push_pull("x", np.arange(3.0)), np.arange(3.0)
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kept", [4096, 2])
def test_a_call_is_prepared_once_per_signature(
    start_servers, kept, monkeypatch
):
    # A call keeps what it computes once (checks, wire names, plan) per
    # signature; a name that comes back with another shape, dtype or empty
    # gets its own, and one seen before its old keys and rounds: the sums
    # stay exact, also where the kept signatures are dropped past a bound.
    monkeypatch.setattr(runtime_module, "MAX_CACHED_CALLS", kept)
    servers = start_servers(1, 2)
    steps = [
        ((3, 4), np.float32),
        ((3, 4), np.float32),
        ((5,), np.float32),
        ((3, 4), np.float64),
        ((0, 4), np.float32),
        ((3, 4), np.float32),
        ((5,), np.float32),
    ]

    def fn(rt):
        got = []
        for step, (shape, dtype) in enumerate(steps):
            w = contribution(rt.rank, np.prod(shape), dtype, seed=step)
            b = contribution(rt.rank, 7, np.int32, seed=100 + step)
            outs = rt.push_pull_async(
                ["w", "b"], [w.reshape(shape), b], average=False
            ).wait()
            got.append(outs)
        return got, len(rt._calls)

    for got, calls in run_workers(2, servers, fn, partition_bytes=SMALL):
        assert calls == min(kept, 4), calls  # four signatures
        for step, ((shape, dtype), (w, b)) in enumerate(zip(steps, got)):
            expected = sum(
                contribution(r, np.prod(shape), np.float64, seed=step)
                for r in range(2)
            )
            assert (w.shape, w.dtype) == (shape, np.dtype(dtype)), step
            np.testing.assert_array_equal(w, expected.reshape(shape))
            expected = sum(
                contribution(r, 7, np.int64, seed=100 + step) for r in range(2)
            )
            np.testing.assert_array_equal(b, expected)


@pytest.mark.timeout(120)
def test_fused_small_tensors_of_mixed_dtypes(start_servers):
    servers = start_servers(2, 2)
    dtypes = [np.float32, np.int32, np.float32, np.float64, np.int64] * 4
    sizes = [1, 7, 100, 33, 2] * 4

    def fn(rt):
        arrays = [
            contribution(rt.rank, s, d, seed=i)
            for i, (s, d) in enumerate(zip(sizes, dtypes))
        ]
        names = [f"p{i}" for i in range(len(arrays))]
        return [
            rt.push_pull_async(names, arrays, average=False).wait()
            for _ in range(3)
        ]

    for rounds in run_workers(2, servers, fn, partition_bytes=1024):
        for outs in rounds:
            for i, (out, s, d) in enumerate(zip(outs, sizes, dtypes)):
                expected = sum(
                    contribution(r, s, np.float64, seed=i) for r in range(2)
                ).astype(d)
                assert out.dtype == np.dtype(d)
                np.testing.assert_array_equal(out, expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("joined", [True, False], ids=["joined", "parts"])
@pytest.mark.parametrize("transport", ["grpc", "tcp", "auto"])
def test_fused_pieces_of_more_tensors_than_one_send_takes(
    start_servers, transport, joined, monkeypatch
):
    # A fused piece's payload is a Gather of its members: the data channel
    # sends small parts joined, and else more of them than one sendmsg
    # takes in several calls; shared memory copies them into the slot, gRPC
    # joins them.
    from jaxps._src.transport import base

    if not joined:  # every part as it is, whatever its size
        monkeypatch.setattr(base, "JOIN_BELOW", 0)
    servers = start_servers(1, 2)
    count = _wire.SEND_VECTORS + 300
    sizes = [1 + i % 3 for i in range(count)]

    def fn(rt):
        arrays = [
            contribution(rt.rank, s, np.float32, seed=i)
            for i, s in enumerate(sizes)
        ]
        names = [f"g{i}" for i in range(count)]
        outs = rt.push_pull_async(names, arrays, average=False).wait()
        (inner,) = [t.current for t in rt._transports]
        data = getattr(inner, "small", inner)  # shm sends these on it
        return outs, getattr(data, "connection", "none")

    results = run_workers(
        2, servers, fn, partition_bytes=64 << 10, transport=transport
    )
    for outs, connection in results:
        # none fell back to gRPC: the data channel is still up
        assert connection is not None, transport
        for i, (out, s) in enumerate(zip(outs, sizes)):
            expected = sum(
                contribution(r, s, np.float64, seed=i) for r in range(2)
            ).astype(np.float32)
            np.testing.assert_array_equal(out, expected, err_msg=f"g{i}")


@pytest.mark.timeout(120)
def test_mixed_mode_cpu_and_colocated_servers(start_servers):
    cpu = start_servers(1, 2)
    colocated = start_servers(2, 2)
    addresses = tuple(s.address for s in colocated)

    def fn(rt):
        assert len(rt.weights) == 3 and rt.weights[0] > rt.weights[1]
        return rt.push_pull(
            "m", np.full(40_000, rt.rank + 1.0, np.float32), average=False
        )

    for out in run_workers(
        2, cpu, fn, colocated_servers=addresses, partition_bytes=4096
    ):
        np.testing.assert_array_equal(out, 3.0)


@pytest.mark.timeout(120)
def test_priorities_let_the_first_layer_overtake_queued_layers(
    start_servers, monkeypatch
):
    (server,) = start_servers(1, 1)
    cfg = Config(
        servers=(server.address,),
        partition_bytes=64 * 1024,
        credit_bytes=64 * 1024,
    )
    rt = Runtime(cfg, senders_per_server=1, channels_per_server=1)
    order = []
    finish = runtime_module.Handle._finish

    def finished(handle):  # the order in which the sums came, exactly
        # (polling the handles on a loaded machine saw several at once)
        order.append(int(handle.names[0].removeprefix("layer")))
        finish(handle)

    monkeypatch.setattr(runtime_module.Handle, "_finish", finished)
    try:
        grads = np.ones(64 * 1024, np.float32)  # 4 chunks per layer
        handles = [
            (
                layer,
                rt.push_pull_async(
                    [f"layer{layer}"], [grads], priorities=[-layer]
                ),
            )
            for layer in reversed(range(12))  # backward order: last first
        ]
        for _, handle in handles:
            handle.wait()
    finally:
        rt.close()
    # layer 11 was queued first and went out at once; layer 0, queued last,
    # jumps ahead of everything still waiting for credit
    assert order.index(0) <= 2, order
    assert order[-1] != 0, order


@pytest.mark.timeout(60)
def test_sums_and_async_servers_do_not_mix(start_servers):
    # the mode travels with each call: the same name may be either
    (async_server,) = start_servers(1, 1, "--async")
    (sync_server,) = start_servers(1, 1)
    rt = Runtime(Config(servers=(async_server.address,)))
    try:
        assert rt.async_servers
        with pytest.raises(errors.JaxpsError, match="needs synchronous"):
            rt.push_pull("grads", np.ones(3, np.float32))
        got = rt.push_pull("grads", np.ones(3, np.float32), mode="async")
        np.testing.assert_array_equal(got, 1.0)  # round 0: initial value
    finally:
        rt.close()
    rt = Runtime(Config(servers=(sync_server.address,)))
    try:
        assert not rt.async_servers
        with pytest.raises(errors.JaxpsError, match="needs servers started"):
            rt.push_pull("params/w", np.ones(3, np.float32), mode="async")
        with pytest.raises(ValueError, match="mode must be one of"):
            rt.push_pull("params/w", np.ones(3, np.float32), mode="Async")
        got = rt.push_pull("params/w", np.ones(3, np.float32))
        np.testing.assert_array_equal(got, 1.0)
    finally:
        rt.close()


@pytest.mark.timeout(60)
def test_each_server_client_gets_a_transport(start_servers):
    # a server on 127.0.0.1 gets shared memory unless it is turned off
    (server,) = start_servers(1, 1)
    cases = [
        ({}, ShmTransport),
        ({"shm_bytes": 0}, GrpcTransport),
        ({"transport": "grpc"}, GrpcTransport),
    ]
    for i, (settings, kind) in enumerate(cases):
        cfg = Config(servers=(server.address,), **settings)
        rt = Runtime(cfg, channels_per_server=2)
        try:
            # (each wrapped by the failover's RecoveringTransport)
            assert [type(t.current) for t in rt._transports] == [kind, kind]
            got = rt.push_pull(f"x{i}", np.full(3, 2.0, np.float32))
            np.testing.assert_array_equal(got, 2.0)
        finally:
            rt.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_large_outputs_are_reused_only_once_no_one_holds_them(
    start_servers, transport
):
    n = 2
    servers = start_servers(1, n)
    size = plan.REUSE_BYTES // 4  # float32: the smallest reused output

    def fn(rt):
        held = []
        for step in range(4):  # every result is held: none may be reused
            x = np.full(size, rt.rank + step, np.float32)
            held.append(
                rt.push_pull_async(
                    ["x"], [x], average=False, donate=True
                ).wait()[0]
            )
        pooled = []
        for step in range(4):  # none held: they come from the pool
            x = np.full(size, 10 * step + rt.rank, np.float32)
            out = rt.push_pull_async(["x"], [x], average=False).wait()[0]
            assert out[0] == out[-1] == 20 * step + 1, step
            pooled.append(rt._outputs.pooled(out))
        return held, pooled

    for held, pooled in run_workers(
        n, servers, fn, transport=transport, shm_bytes=0
    ):
        for step, out in enumerate(held):
            assert out.min() == out.max() == 2 * step + 1, step
        assert pooled[1:] == [True] * 3


@pytest.mark.timeout(60)
def test_a_transport_that_raises_fails_only_its_chunk(start_servers):
    """A sender thread fed a non-jaxps exception: the push_pull fails at
    once naming the cause, the credit comes back, the thread lives on."""
    (server,) = start_servers(1, 1)
    rt = Runtime(
        Config(servers=(server.address,), partition_bytes=SMALL, timeout=20)
    )
    try:
        transport = rt._transports[0]
        real = transport.send
        calls = []

        def send(chunk, credit):
            calls.append(chunk)
            if len(calls) == 2:
                raise RuntimeError("Cannot invoke RPC on closed channel")
            real(chunk, credit)

        transport.send = send
        x = np.arange(4 * SMALL, dtype=np.float32)  # 4 chunks
        start = time.monotonic()
        with pytest.raises(errors.JaxpsError, match="closed channel") as e:
            rt.push_pull("w", x, average=False)
        assert time.monotonic() - start < 5
        assert isinstance(e.value.__cause__, RuntimeError)
        deadline = time.monotonic() + 5  # the other chunks end too
        while rt._sender.in_flight:  # and every credit comes back
            assert time.monotonic() < deadline, rt._sender.in_flight
            time.sleep(0.01)
        assert all(t.is_alive() for t in rt._sender.threads)
        for name in ("a", "b", "c"):  # the job goes on, every thread used
            np.testing.assert_array_equal(
                rt.push_pull(name, x, average=False), x
            )
    finally:
        rt.close()


@pytest.mark.timeout(60)
def test_a_call_failed_on_one_rank_is_heard_by_the_others_at_once(
    start_servers,
):
    """Rank 0's call fails before its pieces leave (a transport raised):
    it gives up their rounds, and rank 1, waiting for them, hears why
    within 2 s instead of at the 20 s timeout."""
    (server,) = start_servers(1, 2)
    config = dict(servers=(server.address,), num_workers=2, timeout=20)
    config.update(partition_bytes=SMALL, transport="grpc")
    runtimes = [Runtime(Config(worker_rank=r, **config)) for r in range(2)]
    try:
        transport = runtimes[0]._transports[0]
        real = transport.send

        def send(chunk, credit):
            if chunk.header.name.startswith("w"):
                raise RuntimeError("the device is gone")
            real(chunk, credit)

        transport.send = send
        x = np.arange(8 * SMALL, dtype=np.float32)  # 8 chunks
        start = time.monotonic()
        handles = [rt.push_pull_async(["w"], [x]) for rt in runtimes]
        with pytest.raises(errors.JaxpsError, match="the device is gone"):
            handles[0].wait()
        with pytest.raises(errors.JaxpsError) as e:
            handles[1].wait()
        assert time.monotonic() - start < 2.0
        assert "rank 0 gave up" in str(e.value), str(e.value)
        assert "the device is gone" in str(e.value)
    finally:
        for rt in runtimes:
            rt.close()


def test_a_lost_server_ends_a_call_without_waiting_for_its_check():
    # While the call check is out, a chunk's error waits for it (a mismatch
    # fails pieces too, and the check's error names it). A server gone is
    # no mismatch: it ends the call at once, and a check that then times out
    # (its other ranks failed on the same server) does not hide it.
    def handle():
        return runtime_module.Handle(
            ["x"], [np.zeros(4)], [(4,)], 3, None, 5.0, checked=True
        )

    waits = handle()
    waits.fail(errors.RequestRejectedError("length 4 against 8"))
    assert not waits.done()
    waits.check_ended(MismatchError("rank 1 calls x with float32[8]"))
    assert waits.done()
    with pytest.raises(MismatchError, match="rank 1"):
        waits.wait(0)

    for lost in (
        errors.ServerUnavailableError("server a:1 did not come back"),
        errors.ServerRestartedError("server a:1 restarted"),
    ):
        ends = handle()
        ends.fail(lost)
        assert ends.done()
        ends.check_ended(errors.RoundTimeoutError("waiting for rank(s) [1]"))
        with pytest.raises(type(lost), match="a:1"):
            ends.wait(0)
