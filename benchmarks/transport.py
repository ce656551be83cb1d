"""CPU cost per GB of jaxps's payload paths next to bare gRPC and raw TCP.

Run from the repository root:

    python benchmarks/transport.py [--sizes-mib 4,64] [--total-mib 2048]

One client and one server process on 127.0.0.1 move ``--total-mib`` of
payload up and the same back, in calls of each size, for every path:

* ``tcp``: a raw TCP echo (the machine's limit): the client sends a call's
  bytes while a second thread reads them back as the server echoes them.
* ``tls-echo``: the same echo over Python's TLS (run with ``tls`` among
  ``--transports``): the limit of a TLS data channel in Python.
* ``grpc-echo``: a bare gRPC Python echo (``grpc.aio`` server, raw bytes, no
  protobuf), a call sent as messages of at most ``--partition-mib``, all in
  flight at once.
* ``jaxps-<transport>``: ``Runtime.push_pull`` of a float32 array (donated,
  as the ops donate their device-to-host copies) against a
  1-worker ``jaxps-server`` with shared memory off: the path of a server on
  another host. ``--transports`` picks them (``grpc``: payloads in gRPC
  messages; ``tcp``: the data channel; ``tls``: the data channel of a
  server with TLS, a self-signed certificate made for the run;
  ``grpc-tls``: payloads in gRPC messages to that server, which was the
  only TLS path before the data channel spoke TLS).

CPU is user+sys of both processes over the timed calls (so it holds on a
busy machine); cpu-s/GB counts the bytes sent up (10^9 bytes). The table
gives each path's cost over the TCP echo's, the gRPC echo's and the plaintext
data channel's (``jaxps-tcp``), measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time

import _common
import numpy as np
from _common import LOOPBACK, MB, Child, log

RESULT = "RESULT "
READY = "READY "
_LEN = struct.Struct("<Q")


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(call, calls: int, server_pid: int) -> dict:
    """Runs `call` once to warm up, then `calls` times, timed."""
    call()
    wall, cpu, server = time.perf_counter(), _cpu_self(), _cpu_of(server_pid)
    for _ in range(calls):
        call()
    return {
        "wall": time.perf_counter() - wall,
        "cpu_client": _cpu_self() - cpu,
        "cpu_server": _cpu_of(server_pid) - server,
    }


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while len(view):
        n = sock.recv_into(view, len(view), flags)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


# -- servers -------------------------------------------------------------------


def tcp_server(args) -> None:
    """Echoes length-prefixed messages on one connection."""
    with socket.create_server((LOOPBACK, 0)) as listener:
        print(READY + str(listener.getsockname()[1]), flush=True)
        conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if args.tls_key:  # tls-echo
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.tls_cert, args.tls_key)
        conn = context.wrap_socket(conn, server_side=True)
    buf = memoryview(bytearray(max(args.sizes_mib) * MB))
    head = memoryview(bytearray(_LEN.size))
    while True:
        try:
            _recv_exact(conn, head)
        except ConnectionError:
            return
        (n,) = _LEN.unpack(head)
        conn.sendall(head)
        # Echo while the bytes arrive, a partition at a time.
        step = args.partition_mib * MB
        for lo in range(0, n, step):
            part = buf[lo : min(n, lo + step)]
            _recv_exact(conn, part)
            conn.sendall(part)


def grpc_server(args) -> None:
    """A bare grpc.aio echo service of raw bytes."""
    import grpc

    async def echo(request, context):
        del context
        return request

    async def serve():
        limit = args.partition_mib * MB + 65536
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", limit),
                ("grpc.max_receive_message_length", limit),
            ]
        )
        handler = grpc.method_handlers_generic_handler(
            "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port(f"{LOOPBACK}:0")
        await server.start()
        print(READY + str(port), flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


# -- clients -------------------------------------------------------------------


def tcp_client(args) -> dict:
    sock = socket.create_connection((LOOPBACK, args.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if args.tls_cert:  # tls-echo
        context = ssl.create_default_context(cafile=args.tls_cert)
        sock = context.wrap_socket(sock, server_hostname=LOOPBACK)
    nbytes = args.size_mib * MB
    out = np.random.default_rng(0).bytes(nbytes)
    back = memoryview(bytearray(nbytes))
    head = memoryview(bytearray(_LEN.size))

    def send():
        sock.sendall(_LEN.pack(nbytes))
        sock.sendall(out)

    def call():
        sender = threading.Thread(target=send)
        sender.start()
        _recv_exact(sock, head)
        _recv_exact(sock, back)
        sender.join()

    result = _measure(call, args.calls, args.server_pid)
    assert back == out, "tcp echo corrupted the data"
    return result


def grpc_client(args) -> dict:
    import grpc

    limit = args.partition_mib * MB + 65536
    channel = grpc.insecure_channel(
        f"{LOOPBACK}:{args.port}",
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ],
    )
    echo = channel.unary_unary("/bench.Echo/Echo")
    nbytes = args.size_mib * MB
    step = min(nbytes, args.partition_mib * MB)
    out = np.random.default_rng(0).bytes(nbytes)
    parts = [out[lo : lo + step] for lo in range(0, nbytes, step)]
    got = []

    def call():
        futures = [echo.future(p, timeout=120) for p in parts]
        got[:] = [f.result() for f in futures]

    result = _measure(call, args.calls, args.server_pid)
    assert b"".join(got) == out, "grpc echo corrupted the data"
    channel.close()
    return result


def jaxps_client(args) -> dict:
    from jaxps._src.config import Config
    from jaxps._src.runtime import Runtime

    settings = dict(
        servers=(f"{LOOPBACK}:{args.port}",),
        num_workers=1,
        worker_rank=0,
        shm_bytes=0,
        partition_bytes=args.partition_mib * MB,
    )
    if args.transport == "tls":
        settings.update(transport="tcp", tls_ca=args.tls_cert)
    elif args.transport == "grpc-tls":
        settings.update(transport="grpc", tls_ca=args.tls_cert)
    elif args.transport != "grpc-default":
        settings["transport"] = args.transport
    rt = Runtime(Config(**settings))
    x = np.random.default_rng(0).random(args.size_mib * MB // 4, np.float32)
    got = []

    def call():
        # as the ops do: `x` is never written, so it is donated
        handle = rt.push_pull_async(["x"], [x], average=False, donate=True)
        got[:] = handle.wait()

    result = _measure(call, args.calls, args.server_pid)
    np.testing.assert_array_equal(got[0], x)
    rt.close()
    return result


# -- driver --------------------------------------------------------------------


def _server_argv(path: str, args) -> list[str]:
    if path.startswith("jaxps"):
        tls = []
        if path in ("jaxps-tls", "jaxps-grpc-tls"):
            tls = ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
        return [sys.executable, "-m", "jaxps.servers", "--port", "0"] + [
            "--num-workers",
            "1",
            "--max-message-bytes",
            str(args.partition_mib * MB + 65536),
            *tls,
        ]
    role = "grpc-server" if path == "grpc-echo" else "tcp-server"
    tls = []
    if path == "tls-echo":
        tls = ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
    return [sys.executable, os.path.abspath(__file__), "--role", role, *tls] + [
        "--sizes-mib",
        ",".join(map(str, args.sizes_mib)),
        "--partition-mib",
        str(args.partition_mib),
    ]


def _certificate(directory: str) -> tuple[str, str]:
    """A self-signed certificate and key for 127.0.0.1, for ``jaxps-tls``."""
    cert = os.path.join(directory, "cert.pem")
    key = os.path.join(directory, "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
         "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def run_path(path: str, size_mib: int, args, log_dir: str) -> dict:
    ready = "jaxps-server listening on " if path.startswith("jaxps") else READY
    with _common.children() as started:
        server = Child(f"{path}-{size_mib}-server", _server_argv(path, args),
                       log_dir)  # fmt: skip
        started.append(server)
        port = server.wait_for_line(ready, 60).rpartition(":")[2]
        calls = max(2, args.total_mib // size_mib)
        role = "jaxps-client" if path.startswith("jaxps") else f"{path}-client"
        if path == "tls-echo":
            role = "tcp-client"
        argv = [sys.executable, os.path.abspath(__file__), "--role", role]
        argv += ["--port", port, "--server-pid", str(server.proc.pid)]
        argv += ["--size-mib", str(size_mib), "--calls", str(calls)]
        argv += ["--partition-mib", str(args.partition_mib)]
        if path.startswith("jaxps-"):
            argv += ["--transport", path[len("jaxps-") :]]
        if path.startswith("jaxps-") or path == "tls-echo":
            argv += ["--tls-cert", args.tls_cert]
        client = Child(f"{path}-{size_mib}-client", argv, log_dir)
        started.append(client)
        line = client.wait_for_line(RESULT, args.call_timeout)
    result = json.loads(line)
    gb = calls * size_mib * MB / 1e9
    cpu = result["cpu_client"] + result["cpu_server"]
    return {
        "cpu_per_gb": cpu / gb,
        "server_cpu_per_gb": result["cpu_server"] / gb,
        "gbps": gb / result["wall"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", default="4,64")
    p.add_argument("--total-mib", type=int, default=2048)
    p.add_argument("--partition-mib", type=int, default=4)
    p.add_argument("--transports", default="grpc,tcp,tls")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--call-timeout", type=float, default=300)
    # child roles
    p.add_argument("--role", default="driver")
    p.add_argument("--port", type=int)
    p.add_argument("--server-pid", type=int)
    p.add_argument("--size-mib", type=int)
    p.add_argument("--calls", type=int)
    p.add_argument("--transport", default="grpc")
    p.add_argument("--tls-cert", default="")
    p.add_argument("--tls-key", default="")
    args = p.parse_args(argv)
    args.sizes_mib = [int(s) for s in args.sizes_mib.split(",")]
    roles = {
        "tcp-server": tcp_server,
        "grpc-server": grpc_server,
        "tcp-client": tcp_client,
        "grpc-echo-client": grpc_client,
        "jaxps-client": jaxps_client,
    }
    if args.role != "driver":
        result = roles[args.role](args)
        if result is not None:
            print(RESULT + json.dumps(result), flush=True)
        return 0

    transports = [t for t in args.transports.split(",") if t]
    paths = ["tcp", "grpc-echo"] + (["tls-echo"] if "tls" in transports else [])
    paths += [f"jaxps-{t}" for t in transports]
    table: dict = {}
    with tempfile.TemporaryDirectory(prefix="jaxps-transport-") as log_dir:
        args.tls_cert, args.tls_key = _certificate(log_dir)
        for rep in range(args.repeats):
            for size in args.sizes_mib:
                for path in paths:
                    r = run_path(path, size, args, log_dir)
                    log(
                        f"rep {rep} {path} {size} MiB: "
                        f"{r['cpu_per_gb']:.2f} cpu-s/GB, "
                        f"{r['gbps']:.2f} GB/s"
                    )
                    table.setdefault((path, size), []).append(r)
    header = ["path", "MiB/call", "cpu-s/GB", "server cpu-s/GB", "GB/s"]
    header += ["x tcp", "x grpc-echo", "x jaxps-tcp"]
    rows = []
    for size in args.sizes_mib:
        base = {
            peer: _common.median([r["cpu_per_gb"] for r in table[(peer, size)]])
            for peer in ("tcp", "grpc-echo", "jaxps-tcp")
            if (peer, size) in table
        }
        for path in paths:
            runs = table[(path, size)]
            cpu = _common.median([r["cpu_per_gb"] for r in runs])
            rows.append(
                [
                    path,
                    str(size),
                    f"{cpu:.2f}",
                    f"{_common.median([r['server_cpu_per_gb'] for r in runs]):.2f}",  # noqa: E501
                    f"{_common.median([r['gbps'] for r in runs]):.2f}",
                    f"{cpu / base['tcp']:.2f}",
                    f"{cpu / base['grpc-echo']:.2f}",
                    f"{cpu / base['jaxps-tcp']:.2f}"
                    if "jaxps-tcp" in base
                    else "",
                ]
            )
    print(_common.format_table(header, rows))
    print(
        f"(median of {args.repeats} runs of {args.total_mib} MiB each, "
        f"partitions of {args.partition_mib} MiB; load average "
        f"{_common.load_average()})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
