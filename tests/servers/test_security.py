"""Token auth, TLS, protocol version and health, against real servers."""

import concurrent.futures

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxps import errors
from jaxps._src.config import Config
from jaxps._src.runtime import Runtime
from jaxps.servers import _codec, _wire
from jaxps.servers import jaxps_pb2 as pb


def runtime(server, rank=0, n=1, **kw):
    return Runtime(
        Config(
            servers=(server.address,),
            num_workers=n,
            worker_rank=rank,
            timeout=5.0,
            **kw,
        )
    )


def raw_push(address, header, array, metadata=None):
    with grpc.insecure_channel(address) as channel:
        push = channel.unary_unary(
            "/jaxps.Summation/Push",
            response_deserializer=pb.PushReply.FromString,
        )
        return push(
            _codec.encode_push(header, array, 0), timeout=5, metadata=metadata
        )


def header(rank, key=1, length=4, version=_wire.PROTOCOL_VERSION):
    return pb.Header(
        version=version,
        job_id="jaxps",
        rank=rank,
        key=key,
        round=0,
        dtype=pb.FLOAT32,
        length=length,
        name="t",
    )


@pytest.mark.timeout(60)
def test_token_required_and_unauthenticated_push_never_sums(start_servers):
    (server,) = start_servers(1, 2, "--token", "s3cret")
    with pytest.raises(errors.RequestRejectedError, match="UNAUTHENTICATED"):
        runtime(server, n=2)
    with pytest.raises(grpc.RpcError) as e:
        raw_push(server.address, header(0), np.full(4, 100, np.float32))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        raw_push(
            server.address,
            header(0),
            np.full(4, 100, np.float32),
            metadata=(("jaxps-token", "wrong"),),
        )
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    def work(rank):
        rt = runtime(server, rank=rank, n=2, token="s3cret")
        try:
            return rt.push_pull("t", np.ones(4, np.float32), average=False)
        finally:
            rt.close()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(work, [0, 1]))
    for out in outs:  # the rejected pushes of 100 never reached the sum
        np.testing.assert_array_equal(out, 2)


@pytest.mark.timeout(60)
def test_tls(start_servers, certificate):
    cert, key = certificate
    (server,) = start_servers(1, 1, "--tls-cert", cert, "--tls-key", key)
    rt = runtime(server, tls_ca=cert)
    try:
        out = rt.push_pull("t", np.arange(3, dtype=np.float32))
        np.testing.assert_array_equal(out, np.arange(3))
    finally:
        rt.close()
    with pytest.raises(errors.ServerUnavailableError):
        Runtime(Config(servers=(server.address,), timeout=2.0))


@pytest.mark.timeout(60)
def test_protocol_version_mismatch_names_both(start_servers):
    (server,) = start_servers(1, 1)
    with pytest.raises(grpc.RpcError) as e:
        raw_push(server.address, header(0, version=99), np.ones(4, np.float32))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (
        f"worker speaks version 99, server speaks {_wire.PROTOCOL_VERSION}"
        in e.value.details()
    )


@pytest.mark.timeout(60)
def test_health_service(start_servers):
    (server,) = start_servers(1, 1, "--token", "x")  # health needs no token
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "jaxps.Summation"):
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_empty_token_is_refused_by_server_and_worker():
    import subprocess
    import sys

    from jaxps import errors
    from jaxps._src.config import Config

    res = subprocess.run(
        [sys.executable, "-m", "jaxps.servers", "--num-workers", "1"]
        + ["--token", ""],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "--token" in res.stderr, res.stderr
    with pytest.raises(errors.ConfigError, match="token must be"):
        Config(token="")


@pytest.mark.parametrize(
    "host, token, warns",
    [
        ("0.0.0.0", None, True),
        ("10.1.2.3", None, True),
        ("cpu3.example", None, True),
        ("0.0.0.0", "s3cret", False),
        ("127.0.0.1", None, False),
        ("localhost", None, False),
        ("[::1]", None, False),
    ],
)
def test_non_loopback_without_token_warns(host, token, warns):
    from jaxps.servers import _cli

    warning = _cli.auth_warning(host, token)
    assert bool(warning) == warns, warning
    if warns:
        assert host in warning and "--token" in warning
