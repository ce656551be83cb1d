"""The ``jaxps-server`` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from . import _server
from ._wire import READY_PREFIX


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxps-server",
        description="Run a jaxps summation server: it sums the gradient "
        "chunks pushed by all workers and answers their pulls.",
    )
    d = _server.ServerOptions()
    p.add_argument(
        "--host",
        default=d.host,
        help="interface to bind (default %(default)s; use 0.0.0.0 "
        "to serve other machines)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=d.port,
        help="TCP port, 0 for a free one (default %(default)s)",
    )
    p.add_argument(
        "--num-workers",
        type=int,
        default=os.environ.get("JAXPS_NUM_WORKERS"),
        help="number of worker ranks (default $JAXPS_NUM_WORKERS)",
    )
    p.add_argument(
        "--job-id",
        default=None,
        help="job id to accept (default: the first worker's)",
    )
    p.add_argument(
        "--engine-threads",
        type=int,
        default=d.engine_threads,
        help="summation threads (default %(default)s)",
    )
    p.add_argument(
        "--round-timeout",
        type=float,
        default=d.round_timeout,
        help="seconds before an incomplete round fails for every "
        "worker (default %(default)s)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="sum in rank order for bitwise reproducible sums",
    )
    p.add_argument(
        "--no-data-channel",
        dest="data_channel",
        action="store_false",
        help="do not offer the data channel (plain TCP on a second, free "
        "port for bulk payloads); workers then send payloads in gRPC "
        "messages",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=d.max_message_bytes,
        help="largest accepted message (default %(default)s)",
    )
    p.add_argument(
        "--async",
        dest="async_mode",
        action="store_true",
        help="asynchronous training: hold the parameters, add each worker's "
        "deltas at once and answer pulls with the current parameters",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("JAXPS_TOKEN"),
        help="shared secret every worker must send (default $JAXPS_TOKEN)",
    )
    p.add_argument("--tls-cert", help="PEM certificate: serve over TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca", help="PEM CA: also require client certificates"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (needs prometheus-client)",
    )
    p.add_argument(
        "--status-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="print a one-line status every SECONDS",
    )
    p.add_argument("--log-level", default="WARNING")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs ``jaxps-server``; returns its exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.num_workers is None:
        parser.error("--num-workers is required (or set JAXPS_NUM_WORKERS)")
    try:
        num_workers = int(args.num_workers)
    except ValueError:
        parser.error(
            f"--num-workers must be an integer, got {args.num_workers!r}"
        )
    for name in ("num_workers", "engine_threads", "max_message_bytes"):
        value = num_workers if name == "num_workers" else getattr(args, name)
        if value < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be >= 1, got {value}"
            )
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        parser.error("--tls-client-ca needs --tls-cert and --tls-key")
    if not 0 <= args.port < 65536:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.round_timeout <= 0:
        parser.error(f"--round-timeout must be > 0, got {args.round_timeout}")
    opts = _server.ServerOptions(
        host=args.host,
        port=args.port,
        num_workers=num_workers,
        job_id=args.job_id,
        engine_threads=args.engine_threads,
        round_timeout=args.round_timeout,
        deterministic=args.deterministic,
        async_mode=args.async_mode,
        max_message_bytes=args.max_message_bytes,
        data_channel=args.data_channel,
        token=args.token,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        metrics_port=args.metrics_port,
        status_interval=args.status_interval,
    )

    def ready(server):
        print(f"{READY_PREFIX}{server.address}", flush=True)

    try:
        asyncio.run(_server.serve(opts, ready))
    except (OSError, ValueError) as err:
        print(f"jaxps-server: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
