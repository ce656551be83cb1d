"""The ``jaxps-server`` command line."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import queue
import signal
import sys
import threading
import time

from . import _server
from ._wire import READY_PREFIX


def auth_warning(host: str, token: str | None) -> str | None:
    """What to warn about before listening on `host` with `token`."""
    if token or _is_loopback(host):
        return None
    return (
        f"listening on {host} without --token: anyone who can reach this "
        "port can push into and read every sum; set --token (and "
        "JAXPS_TOKEN on the workers)"
    )


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


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
        help="the only job id to accept (default: any job, each in its "
        "own job incarnations)",
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
        "--max-memory",
        type=int,
        default=None,
        metavar="MIB",
        help="most MiB of sums the server holds at once; past it pushes "
        "get RESOURCE_EXHAUSTED (default: half the host's memory)",
    )
    p.add_argument(
        "--job-idle-timeout",
        type=float,
        default=d.job_idle_timeout,
        help="seconds a job may be idle before the server drops its keys "
        "and rounds (default %(default)s)",
    )
    p.add_argument(
        "--claim-window",
        type=float,
        default=d.claim_window,
        metavar="SECONDS",
        help="seconds after a worker's hello in which another process "
        "claiming the same rank ends the job incarnation, naming both hosts; "
        "later claims start an incarnation of their own, which replaces the "
        "running one only once all its ranks joined (default %(default)s)",
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
        help="do not offer the data channel (TCP on a second port for bulk "
        "payloads, TLS on a TLS server); workers then send payloads in "
        "gRPC messages",
    )
    p.add_argument(
        "--data-port",
        type=int,
        default=0,
        help="TCP port of the data channel, for a firewall or a Kubernetes "
        "Service (default: a free one; with --processes P: PORT..PORT+P-1); "
        "workers that cannot reach it fall back to gRPC messages",
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
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="P",
        help="run P server processes on ports PORT..PORT+P-1 (--port 0: P "
        "free ports; --metrics-port M: M..M+P-1; --data-port D: "
        "D..D+P-1), one GIL each; each prints "
        "its own ready line, and they stop together (default %(default)s)",
    )
    # Set by the --processes supervisor: end when that parent is gone.
    p.add_argument(
        "--parent-pid", type=int, default=None, help=argparse.SUPPRESS
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
    for flag, port in (("--port", args.port), ("--data-port", args.data_port)):
        if not 0 <= port < 65536:
            parser.error(f"{flag} must be in [0, 65535], got {port}")
    if args.data_port and args.data_port == args.port:
        parser.error(f"--data-port and --port are both {args.port}")
    if args.round_timeout <= 0:
        parser.error(f"--round-timeout must be > 0, got {args.round_timeout}")
    if args.max_memory is not None and args.max_memory < 1:
        parser.error(f"--max-memory must be >= 1 MiB, got {args.max_memory}")
    if args.claim_window < 0:
        parser.error(f"--claim-window must be >= 0, got {args.claim_window}")
    if args.job_idle_timeout <= 0:
        parser.error(
            f"--job-idle-timeout must be > 0, got {args.job_idle_timeout}"
        )
    if args.processes < 1:
        parser.error(f"--processes must be >= 1, got {args.processes}")
    if args.token is not None and not args.token:
        parser.error(
            "--token (or JAXPS_TOKEN) is empty: give a secret, or leave it "
            "unset to run without authentication"
        )
    warning = auth_warning(args.host, args.token)
    if warning:
        print(f"jaxps-server: WARNING: {warning}", file=sys.stderr, flush=True)
    for flag, base in (
        ("--port", args.port),
        ("--metrics-port", args.metrics_port),
        ("--data-port", args.data_port),
    ):
        if base and base + args.processes - 1 > 65535:
            parser.error(
                f"{flag} {base} with --processes {args.processes} needs "
                f"ports up to {base + args.processes - 1} > 65535"
            )
    if args.processes > 1:
        return _supervise(sys.argv[1:] if argv is None else list(argv), args)
    if args.parent_pid is not None:
        _watch_parent(args.parent_pid)
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
        data_port=args.data_port,
        max_memory=(None if args.max_memory is None else args.max_memory << 20),
        job_idle_timeout=args.job_idle_timeout,
        claim_window=args.claim_window,
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


#: Seconds the supervisor gives its processes between SIGTERM and SIGKILL.
_STOP_GRACE = 3.0


def _supervise(argv: list[str], args: argparse.Namespace) -> int:
    """Runs ``args.processes`` servers until a signal or one of them ends.

    Each child is ``python -m jaxps.servers`` with `argv` and, after it, its
    own ``--port`` (and ``--metrics-port``): the last of a flag wins. Ready
    lines are copied as they are, other lines with a ``[process i]`` prefix.

    Returns:
      0 after SIGTERM, SIGINT or SIGHUP; 1 when a process ended by itself.
    """
    from jaxps._src.launch import process  # stdlib only: no JAX

    events: queue.SimpleQueue = queue.SimpleQueue()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: events.put(("signal", signum)))
    lock = threading.Lock()

    def copier(i: int) -> process.LineCallback:
        def on_line(stream: str, text: str) -> None:
            if not text.startswith(READY_PREFIX):
                text = f"[process {i}] {text}"
            with lock:
                try:
                    out = sys.stdout if stream == "stdout" else sys.stderr
                    print(text, file=out, flush=True)
                except (OSError, ValueError):
                    pass  # our own output is gone; keep draining

        return on_line

    children: list[process.Child] = []
    try:
        for i in range(args.processes):
            port = args.port + i if args.port else 0
            extra = ["--processes", "1", "--parent-pid", str(os.getpid())]
            extra += ["--port", str(port)]
            if args.metrics_port:
                extra += ["--metrics-port", str(args.metrics_port + i)]
            if args.data_port:
                extra += ["--data-port", str(args.data_port + i)]
            children.append(
                process.Child(
                    f"process {i} (--port {port})",
                    [sys.executable, "-m", "jaxps.servers", *argv, *extra],
                    on_line=copier(i),
                    on_exit=lambda child: events.put(("exit", child)),
                )
            )
    except OSError as err:
        print(f"jaxps-server: error: {err}", file=sys.stderr)
        process.stop_all(children, _STOP_GRACE)
        return 1
    try:
        while True:
            try:
                kind, what = events.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "signal":
                return 0
            print(
                f"jaxps-server: {what.name} ended with code "
                f"{what.returncode}; stopping the other processes",
                file=sys.stderr,
                flush=True,
            )
            return 1
    finally:
        process.stop_all(children, _STOP_GRACE)


def _watch_parent(parent: int) -> None:
    """SIGTERM to this process once `parent` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
