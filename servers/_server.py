"""Creating, running and stopping a summation server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from . import _auth, _data, _fdpass, _metrics, _service, _summation, _wire

log = logging.getLogger("jaxps.server")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """Settings of one summation server.

    Attributes:
      host: interface to bind; loopback unless told otherwise.
      port: TCP port; 0 picks a free one.
      num_workers: number of worker ranks that push every round.
      job_id: the only job id accepted; ``None`` serves any job, each in
        its own job incarnations (`_jobs`).
      engine_threads: threads that sum payloads.
      round_timeout: seconds before an incomplete round fails for everyone.
      deterministic: sum in rank order (bitwise reproducible).
      async_mode: hold parameters and add workers' deltas at once, without
        rounds (BytePS async mode).
      max_message_bytes: largest accepted request or reply.
      grace: seconds in-flight calls get to finish on shutdown.
      token: shared secret every call must carry (``None``: no check).
      tls_cert: PEM certificate file; with `tls_key` the server speaks TLS.
      tls_key: PEM private key file.
      tls_client_ca: PEM CA file; if given, clients need a certificate.
      metrics_port: serve Prometheus metrics on this port (None: off).
      status_interval: print a one-line status every so many seconds
        (None: off).
      data_channel: offer workers the data channel (TCP for bulk payloads,
        `_data`; TLS with the same certificates on a TLS server).
      data_port: the data channel's TCP port (0: a free one); fix it for a
        firewall or a Kubernetes Service.
      max_memory: most bytes of accumulators and sums held at once (None:
        half the host's memory); past it a push gets RESOURCE_EXHAUSTED.
      claim_window: seconds after a worker's Hello in which another process
        claiming its rank ends the job incarnation, named to both (later
        claims form an incarnation of their own, see `_jobs`).
      job_idle_timeout: seconds a job incarnation may be idle before its
        keys and rounds are dropped.
    """

    host: str = "127.0.0.1"
    port: int = 0
    num_workers: int = 1
    job_id: str | None = None
    engine_threads: int = 2
    round_timeout: float = 60.0
    deterministic: bool = False
    async_mode: bool = False
    max_message_bytes: int = 64 * 1024 * 1024 + 65536
    grace: float = 2.0
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    metrics_port: int | None = None
    status_interval: float | None = None
    data_channel: bool = True
    data_port: int = 0
    max_memory: int | None = None
    job_idle_timeout: float = 600.0
    claim_window: float = 30.0


class Server:
    """A running summation server (use `create_server`)."""

    def __init__(self, server, servicer, health, port: int, opts):
        self.grpc_server = server
        self.servicer = servicer
        #: The gRPC-free core the servicer (and any other transport) calls.
        self.summation = servicer.summation
        self.health = health
        self.port = port
        self.options = opts
        self._expiry: asyncio.Task | None = None
        self._status: asyncio.Task | None = None
        self._metrics = None

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    async def start(self) -> None:
        await self.grpc_server.start()
        if self.options.metrics_port is not None:
            self._metrics = _metrics.start_prometheus(
                self.summation.jobs,
                self.options.host,
                self.options.metrics_port,
            )
        if self.options.status_interval:
            self._status = asyncio.get_running_loop().create_task(
                self._print_status(self.options.status_interval)
            )
        await self.health.set(
            _wire.SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING
        )
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._expiry = asyncio.get_running_loop().create_task(
            self.summation.expire_forever()
        )

    async def stop(self, grace: float | None = None) -> None:
        """Marks the server NOT_SERVING, then stops it after `grace` s."""
        await self.health.enter_graceful_shutdown()
        for task in (self._expiry, self._status):
            if task is not None:
                task.cancel()
        if self._metrics is not None:
            self._metrics.shutdown()
        grace = self.options.grace if grace is None else grace
        await self.grpc_server.stop(grace)
        if self.servicer.data is not None:
            self.servicer.data.close()
        if self.servicer.shm is not None:
            self.servicer.shm.close()
        self.summation.close()

    async def _print_status(self, interval: float) -> None:
        status = _metrics.StatusLine(self.address)
        while True:
            await asyncio.sleep(interval)
            print(status.line(self.summation.jobs), flush=True)

    async def wait(self) -> None:
        await self.grpc_server.wait_for_termination()


def default_max_memory() -> int:
    """Half the host's physical memory, in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):
        return 8 << 30


def create_server(opts: ServerOptions) -> Server:
    """Builds a server bound to ``opts.host:opts.port`` (not yet started).

    Must be called with a running asyncio event loop.
    """
    summation = _summation.Summation(
        opts.num_workers,
        job_id=opts.job_id,
        round_timeout=opts.round_timeout,
        engine_threads=opts.engine_threads,
        deterministic=opts.deterministic,
        async_mode=opts.async_mode,
        max_memory=(
            default_max_memory() if opts.max_memory is None else opts.max_memory
        ),
        idle_timeout=opts.job_idle_timeout,
        claim_window=opts.claim_window,
    )
    servicer = _service.SummationServicer(summation)
    options = _wire.channel_options(opts.max_message_bytes) + [
        ("grpc.so_reuseport", 0),
    ]
    interceptors = []
    if opts.token:
        interceptors.append(_auth.TokenInterceptor(opts.token))
    server = grpc.aio.server(options=options, interceptors=interceptors)
    server.add_generic_rpc_handlers((servicer.handler(),))
    health = health_async.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"{opts.host}:{opts.port}"
    if bool(opts.tls_cert) != bool(opts.tls_key):
        raise ValueError("TLS needs both a certificate and a key file.")
    try:
        if opts.tls_cert:
            creds = _auth.server_credentials(
                opts.tls_cert, opts.tls_key, opts.tls_client_ca
            )
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as err:
        raise OSError(f"jaxps-server cannot bind {address}: {err}") from err
    if port == 0:
        raise OSError(f"jaxps-server cannot bind {address}: address in use?")
    servicer.shm = _fdpass.FdInbox(f"jaxps-shm-{summation.incarnation}")
    if opts.data_channel:
        tls = None
        if opts.tls_cert:
            tls = _data.server_tls_context(
                opts.tls_cert, opts.tls_key, opts.tls_client_ca
            )
        servicer.data = _data.DataChannel(
            summation,
            opts.host,
            asyncio.get_running_loop(),
            token=opts.token,
            max_payload_bytes=opts.max_message_bytes,
            port=opts.data_port,
            tls=tls,
        )
    return Server(server, servicer, health, port, opts)


async def serve(opts: ServerOptions, ready=None) -> None:
    """Runs a server until SIGTERM or SIGINT, then shuts it down gracefully.

    Args:
      opts: the server settings.
      ready: called with the started `Server` (e.g. to print its address).
    """
    server = create_server(opts)
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    if ready is not None:
        ready(server)
    await stopping.wait()
    log.info("jaxps-server on %s shutting down", server.address)
    await server.stop()
