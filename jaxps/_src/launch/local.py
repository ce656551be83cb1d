"""The ``jaxps-launch`` command: runs a whole jaxps job on one machine.

``jaxps-launch --workers N --servers K -- CMD ARGS...`` starts K summation
servers (``python -m jaxps.servers``) on 127.0.0.1, waits until each one is
listening, then starts N copies of ``CMD ARGS...`` with the ``JAXPS_*``
environment variables that `jaxps.init` reads (``JAXPS_SERVERS``,
``JAXPS_NUM_WORKERS``, ``JAXPS_WORKER_RANK``, ``JAXPS_JOB_ID`` and, with
``--timeout``, ``JAXPS_TIMEOUT``).

Every line a child prints is copied to the launcher's stdout or stderr with a
``[worker r] `` or ``[server i] `` prefix. The launcher exits 0 when every
worker exits 0. Otherwise it exits with the code of the first worker that
failed (``128 + signum`` for a worker killed by a signal), 1 when a server
fails, and ``128 + signum`` when it is itself stopped by SIGINT or SIGTERM. In
all those cases it stops everything it started: SIGTERM to each child's
process group, then SIGKILL to whatever is still alive after a grace period.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import queue
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from jaxps._src.launch import hostfile, process
from jaxps.servers._wire import READY_PREFIX

#: Seconds a server may take to print its ready line.
SERVER_START_TIMEOUT = 30.0
#: Seconds between SIGTERM and SIGKILL when stopping children.
STOP_GRACE = process.STOP_GRACE
#: How often the waits below look at the signal flag.
_TICK = 0.1

_USAGE = (
    "jaxps-launch [-h] (--workers N [--servers K] | --hostfile FILE) "
    "[--server-processes P] [--timeout SECONDS] [--job-id ID] "
    "[--engine-threads T] [--restart-servers R] [--devices-per-worker G] "
    "[--dry-run] "
    "[--async] [--deterministic] [--elastic] "
    "[--ray [--address ADDR] [--gpus-per-worker G] [--cpus-per-server C] "
    "[--server-resource NAME=AMOUNT]] -- CMD [ARGS ...]"
)


class LaunchError(Exception):
    """A failure that ends the job; carries the launcher's exit code."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """The validated settings of one ``jaxps-launch`` run.

    Attributes:
      workers: number of worker processes.
      servers: number of summation servers.
      timeout: the servers' round timeout in seconds.
      job_id: the job id given to servers and workers.
      engine_threads: summation threads per server (None: the server's
        default).
      command: the worker command line.
      worker_env: extra environment variables of every worker.
      server_flags: extra ``jaxps-server`` flags (``--async``, ...).
      hosts: the machines of a multi-host job (from ``--hostfile``), whose
        servers and workers are started over ssh; None runs all locally.
      dry_run: print the command lines instead of running them.
      server_processes: processes of each local server (``jaxps-server
        --processes``); a hostfile gives its own per server line.
      restart_servers: how many times a server that ends while the
        workers run is started again on its port (a hostfile's over ssh;
        the workers fail over to it); 0 stops the job instead.
      elastic: a worker that fails does not stop the job (for
        `jaxps.elastic` programs, whose survivors go on without it); the
        job succeeds if any worker does.
      devices_per_worker: GPUs of each local worker: worker r sees GPUs
        r*G .. r*G+G-1 (``CUDA_VISIBLE_DEVICES``); None leaves them all
        visible to every worker.
      ray: run the servers and workers as Ray actors (`launch.ray`), with
        these settings; None runs them here (or over ssh).
      ray_address: the Ray cluster to join (None: this process's, else a
        new one on this machine).
    """

    workers: int
    servers: int
    timeout: float
    job_id: str
    engine_threads: int | None
    command: tuple[str, ...]
    worker_env: dict[str, str]
    server_flags: tuple[str, ...] = ()
    hosts: hostfile.Hosts | None = None
    dry_run: bool = False
    server_processes: int = 1
    restart_servers: int = 0
    elastic: bool = False
    devices_per_worker: int | None = None
    ray: Any = None  # a launch.ray.RaySettings
    ray_address: str | None = None

    def worker_devices(self, rank: int) -> str | None:
        """The ``CUDA_VISIBLE_DEVICES`` of local worker `rank`, or None."""
        g = self.devices_per_worker
        if g is None:
            return None
        return ",".join(str(d) for d in range(rank * g, (rank + 1) * g))


# ----------------------------------------------------------------------------
# Command line.


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxps-launch",
        usage=_USAGE,
        description="Run a jaxps job on this machine: start K summation "
        "servers, then N workers running CMD with JAXPS_SERVERS, "
        "JAXPS_NUM_WORKERS, JAXPS_WORKER_RANK and JAXPS_JOB_ID set. The "
        "children's output is prefixed with [worker r] / [server i]. If a "
        "worker fails, everything else is stopped and its exit code is "
        "returned.",
        epilog="example: jaxps-launch --workers 2 --servers 1 -- "
        "python train.py --lr 0.1",
    )
    p.add_argument(
        "-w",
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="number of worker processes (>= 1; with --hostfile: its "
        "worker lines)",
    )
    p.add_argument(
        "-s",
        "--servers",
        type=int,
        default=None,
        metavar="K",
        help="number of summation servers (>= 0; 0 only with one worker, "
        "the default for one worker; with --hostfile: its server lines)",
    )
    p.add_argument(
        "--server-processes",
        type=int,
        default=1,
        metavar="P",
        help="processes of each server (jaxps-server --processes P), all "
        "listed in JAXPS_SERVERS; with --hostfile: of its server lines "
        "without processes= (default %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds any jaxps wait may take, given to workers as "
        "JAXPS_TIMEOUT and to servers as --round-timeout "
        "(default $JAXPS_TIMEOUT, else 60)",
    )
    p.add_argument(
        "--job-id",
        default=None,
        metavar="ID",
        help="job id shared by servers and workers (default: a "
        "random jaxps-<hex>)",
    )
    p.add_argument(
        "--engine-threads",
        type=int,
        default=None,
        metavar="T",
        help="summation threads per server (default: jaxps-server's)",
    )
    p.add_argument(
        "--restart-servers",
        type=int,
        default=0,
        metavar="R",
        help="start a server that ends while the workers run again on its "
        "port (a hostfile's over ssh), up to R times in all; the workers "
        "fail over to it without losing a step (synchronous mode). "
        "Default 0: stop the job",
    )
    p.add_argument(
        "--devices-per-worker",
        type=int,
        default=None,
        metavar="G",
        help="give each worker G GPUs of its own: worker r gets "
        "CUDA_VISIBLE_DEVICES=r*G..r*G+G-1 (printed at start). Default: "
        "every worker sees every device; with one worker per host that is "
        "right (it reduces over its devices, then pushes)",
    )
    p.add_argument(
        "--hostfile",
        metavar="FILE",
        help="run on several machines over ssh: lines 'server HOST[:PORT] "
        "[processes=P]' and 'worker HOST' (rank order)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the command line of every server and worker and exit",
    )
    p.add_argument(
        "--async",
        dest="async_mode",
        action="store_true",
        help="start the servers in async mode (for "
        "jaxps.AsyncDistributedOptimizer)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="servers sum in rank order (bitwise reproducible)",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="a worker that fails does not stop the job (jaxps.elastic "
        "programs go on without it); exit 0 if any worker succeeds",
    )
    ray = p.add_argument_group(
        "Ray", "run the servers and workers as actors of a Ray cluster"
    )
    ray.add_argument(
        "--ray",
        action="store_true",
        help="servers as CPU-only actors, workers as actors in a placement "
        "group (pip install 'jaxps[ray]')",
    )
    ray.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to join (default: a new one on this machine)",
    )
    ray.add_argument(
        "--gpus-per-worker",
        type=float,
        default=0,
        metavar="G",
        help="GPUs of each worker actor (default %(default)s)",
    )
    ray.add_argument(
        "--cpus-per-server",
        type=float,
        default=1,
        metavar="C",
        help="CPUs of each server actor (default %(default)s)",
    )
    ray.add_argument(
        "--server-resource",
        action="append",
        default=[],
        metavar="NAME=AMOUNT",
        help="a custom Ray resource each server actor needs, e.g. "
        "cpu_node=0.01 to keep servers on the machines started with "
        "'ray start --resources={\"cpu_node\": 1}' (repeatable)",
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the worker command, after '--'",
    )
    return p


def _split_command(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """Splits `argv` at the first ``--`` into options and command."""
    argv = list(argv)
    if "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def _default_timeout(parser: argparse.ArgumentParser) -> float:
    text = os.environ.get("JAXPS_TIMEOUT", "60")
    try:
        value = float(text)
    except ValueError:
        parser.error(f"JAXPS_TIMEOUT must be a number, got {text!r}")
    if value <= 0:
        parser.error(f"JAXPS_TIMEOUT must be > 0, got {text!r}")
    return value


def _validate(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    command: list[str],
) -> None:
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.servers < 0:
        parser.error(f"--servers must be >= 0, got {args.servers}")
    if args.servers == 0 and args.workers > 1:
        parser.error(
            f"--servers 0 works only with --workers 1: "
            f"{args.workers} workers need at least one summation "
            "server (--servers 1)"
        )
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    if args.engine_threads is not None and args.engine_threads < 1:
        parser.error(
            f"--engine-threads must be >= 1, got {args.engine_threads}"
        )
    if args.job_id is not None and not args.job_id:
        parser.error("--job-id must not be empty")
    if args.devices_per_worker is not None:
        if args.devices_per_worker < 1:
            parser.error(
                "--devices-per-worker must be >= 1, got "
                f"{args.devices_per_worker}"
            )
        if args.hostfile:
            parser.error(
                "--devices-per-worker assigns the GPUs of this machine; "
                "with --hostfile set CUDA_VISIBLE_DEVICES on each host"
            )
    if args.ray:
        for flag, used in (
            ("--hostfile", args.hostfile),
            (
                "--devices-per-worker (use --gpus-per-worker)",
                (args.devices_per_worker is not None),
            ),
            ("--server-processes", args.server_processes > 1),
            ("--elastic", args.elastic),
            ("--dry-run", args.dry_run),
        ):
            if used:
                parser.error(f"--ray does not go with {flag}")
        if args.gpus_per_worker < 0 or not args.cpus_per_server > 0:
            parser.error(
                "--gpus-per-worker must be >= 0 and --cpus-per-server > 0"
            )
    elif args.address or args.server_resource:
        parser.error("--address and --server-resource need --ray")
    if not command:
        parser.error(
            "a worker command is required after '--', e.g. "
            "jaxps-launch --workers 2 --servers 1 -- python train.py"
        )


def parse_args(argv: Sequence[str] | None = None) -> LaunchConfig:
    """Parses and validates the ``jaxps-launch`` command line.

    Args:
      argv: the arguments after the program name (default ``sys.argv[1:]``).

    Returns:
      The launch settings.

    Raises:
      SystemExit: with code 2 after printing a usage error.
    """
    parser = _parser()
    head, tail = _split_command(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(head)
    if args.server_processes < 1:
        parser.error(
            f"--server-processes must be >= 1, got {args.server_processes}"
        )
    if args.restart_servers < 0:
        parser.error(
            f"--restart-servers must be >= 0, got {args.restart_servers}"
        )
    if args.restart_servers and args.server_processes > 1:
        parser.error(
            "--restart-servers restarts single-process local servers, or "
            "the servers of a hostfile (not with --server-processes)"
        )
    hosts = None
    if args.hostfile:
        if args.workers is not None or args.servers is not None:
            parser.error(
                "--hostfile sets the workers and servers; drop "
                "--workers/--servers"
            )
        try:
            with open(args.hostfile) as f:
                hosts = hostfile.parse_hostfile(
                    f.read(), args.hostfile, args.server_processes
                )
        except (OSError, hostfile.HostfileError) as err:
            parser.error(f"--hostfile: {err}")
        args.workers, args.servers = len(hosts.workers), len(hosts.servers)
    if args.workers is None:
        parser.error("--workers is required (or give --hostfile)")
    if args.servers is None:
        if args.workers > 1:
            parser.error(
                f"--servers is required for {args.workers} workers (or "
                "give --hostfile)"
            )
        args.servers = 0  # one worker needs no summation server
    command = list(args.command)
    if tail is not None:
        command = command + ["--"] + tail if command else tail
    _validate(parser, args, command)
    timeout = _default_timeout(parser) if args.timeout is None else args.timeout
    job_id = args.job_id or f"jaxps-{secrets.token_hex(6)}"
    env = {"JAXPS_JOB_ID": job_id, "JAXPS_NUM_WORKERS": str(args.workers)}
    if args.timeout is not None:
        env["JAXPS_TIMEOUT"] = repr(args.timeout)
    ray = None
    if args.ray:
        ray = _ray_settings(parser, args, timeout)
    return LaunchConfig(
        workers=args.workers,
        servers=args.servers,
        timeout=timeout,
        job_id=job_id,
        engine_threads=args.engine_threads,
        server_flags=tuple(
            flag
            for flag, on in (
                ("--async", args.async_mode),
                ("--deterministic", args.deterministic),
            )
            if on
        ),
        command=tuple(command),
        worker_env=env,
        hosts=hosts,
        dry_run=args.dry_run,
        server_processes=args.server_processes,
        restart_servers=args.restart_servers,
        elastic=args.elastic,
        devices_per_worker=args.devices_per_worker,
        ray=ray,
        ray_address=args.address,
    )


def _ray_settings(parser, args, timeout: float):
    """The `launch.ray.RaySettings` of ``--ray`` (Ray is imported only
    when the job starts)."""
    from jaxps._src import errors
    from jaxps._src.launch.ray import RaySettings

    resources = {}
    for item in args.server_resource:
        name, sep, amount = item.partition("=")
        try:
            resources[name] = float(amount)
        except ValueError:
            sep = ""
        if not sep or not name:
            parser.error(f"--server-resource takes NAME=AMOUNT, got {item!r}")
    # the launcher's own JAXPS_* settings go to the workers, as locally;
    # the job's servers, ranks, id and token are the Ray job's
    own = ("SERVERS", "NUM_WORKERS", "WORKER_RANK", "JOB_ID", "TOKEN")
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith("JAXPS_") and k[len("JAXPS_") :] not in own
    }
    options = {"async_mode": args.async_mode}
    if args.deterministic:
        options["deterministic"] = True
    if args.engine_threads is not None:
        options["engine_threads"] = args.engine_threads
    try:
        return RaySettings(
            num_workers=args.workers,
            num_servers=args.servers,
            gpus_per_worker=args.gpus_per_worker,
            cpus_per_server=args.cpus_per_server,
            server_resources=resources or None,
            restart_servers=args.restart_servers,
            round_timeout=timeout,
            server_options=options,
            job_id=args.job_id,
            env=env,
        )
    except errors.ConfigError as err:
        parser.error(str(err))


# ----------------------------------------------------------------------------
# Children.


class _Output:
    """Writes whole lines to the launcher's stdout/stderr, one at a time."""

    def __init__(self, out: IO[str], err: IO[str]):
        self.out = out
        self.err = err
        self._lock = threading.Lock()

    def line(self, stream: IO[str], text: str) -> None:
        """Writes `text` and a newline to `stream`, then flushes it."""
        with self._lock:
            try:
                stream.write(text + "\n")
                stream.flush()
            except (OSError, ValueError):
                pass  # The launcher's own output is gone; keep draining.

    def error(self, message: str) -> None:
        """Writes a launcher message to stderr."""
        self.line(self.err, f"jaxps-launch: {message}")


def exit_code(returncode: int) -> int:
    """Maps a `subprocess` return code to a shell-style exit code.

    Args:
      returncode: a child's return code; negative for a signal.

    Returns:
      `returncode`, or ``128 + signum`` for a child killed by a signal.
    """
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    """Describes how a child ended, e.g. ``exit code 3`` or ``SIGKILL``."""
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


# ----------------------------------------------------------------------------
# The launcher.


class Launcher:
    """Runs the servers and workers of one job and cleans up after them.

    Args:
      config: the launch settings.
      out: where child stdout lines go (default ``sys.stdout``).
      err: where child stderr lines and launcher messages go (default
        ``sys.stderr``).
    """

    def __init__(
        self,
        config: LaunchConfig,
        out: IO[str] | None = None,
        err: IO[str] | None = None,
    ):
        self.config = config
        self.output = _Output(out or sys.stdout, err or sys.stderr)
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.servers: list[process.Child] = []
        self.workers: list[process.Child] = []
        self._addresses: list[str] = []  # of the local servers
        self._restarts = 0
        self.signals: list[int] = []

    def on_signal(self, signum: int, frame: Any = None) -> None:
        """Signal handler: asks the launcher to stop everything."""
        del frame
        self.signals.append(signum)
        self.events.put(("signal", signum))

    def run(self) -> int:
        """Runs the job; returns the launcher's exit code."""
        try:
            self._check_signal()
            addresses = self._start_servers()
            self._start_workers(addresses)
            return self._watch()
        except LaunchError as err:
            self.output.error(str(err))
            return err.code
        finally:
            self.stop()

    def _check_signal(self) -> None:
        if self.signals:
            signum = self.signals[0]
            raise LaunchError(
                f"got {signal.Signals(signum).name}; stopping all processes",
                128 + signum,
            )

    def _child(
        self, label: str, argv: Sequence[str], env: dict[str, str]
    ) -> process.Child:
        """Starts a child whose lines are copied with a ``[label]`` prefix
        and whose exit is put on `events`."""
        prefix = f"[{label}] "
        out = self.output

        def on_line(stream: str, text: str) -> None:
            out.line(out.out if stream == "stdout" else out.err, prefix + text)

        try:
            return process.Child(
                label,
                argv,
                env=env,
                on_line=on_line,
                on_exit=lambda child: self.events.put(("exit", child)),
            )
        except OSError as err:
            code = 127 if isinstance(err, FileNotFoundError) else 126
            raise LaunchError(
                f"cannot start {label} ({argv[0]!r}): {err}", code
            ) from err

    def commands(self) -> list[tuple[str, list[str]]]:
        """(label, argv) of every server and worker this job starts."""
        c = self.config
        if c.hosts is not None:
            return hostfile.ssh_commands(
                c.hosts,
                list(c.command),
                job_id=c.job_id,
                timeout=c.timeout,
                server_flags=c.server_flags,
                worker_env=c.worker_env,
            )
        servers = [
            (f"server {i}", self._server_argv()) for i in range(c.servers)
        ]
        workers = [(f"worker {r}", list(c.command)) for r in range(c.workers)]
        return servers + workers

    def _server_argv(self, port: int = 0) -> list[str]:
        c = self.config
        return process.server_argv(
            c.workers,
            "--round-timeout",
            str(c.timeout),
            "--job-id",
            c.job_id,
            *(
                ()
                if c.engine_threads is None
                else ("--engine-threads", str(c.engine_threads))
            ),
            *(
                ("--processes", str(c.server_processes))
                if c.server_processes > 1
                else ()
            ),
            *c.server_flags,
            host="127.0.0.1",
            port=port,
        )

    def _start_servers(self) -> list[str]:
        """Starts every server, then waits for all of their addresses (one
        per process)."""
        c = self.config
        env = dict(os.environ)
        commands = self.commands()[: c.servers]
        for label, argv in commands:
            self.servers.append(self._child(label, argv, env))
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        if c.hosts is not None:
            counts = c.hosts.counts()
        else:
            counts = (c.server_processes,) * c.servers
        addresses = [
            address
            for server, count in zip(self.servers, counts)
            for address in self._await_ready(server, count, deadline)
        ]
        if c.hosts is not None:  # as named in the hostfile
            return list(c.hosts.addresses())
        self._addresses = addresses
        return addresses

    def _restart(self, child: process.Child) -> None:
        """Starts the server `child` was again, on its port (a hostfile's
        over ssh, with the command that started it)."""
        c = self.config
        i = self.servers.index(child)
        self._restarts += 1
        if c.hosts is not None:
            argv = self.commands()[i][1]
            count = c.hosts.counts()[i]
            where = f"on {c.hosts.servers[i]} over ssh"
        else:
            port = int(self._addresses[i].rpartition(":")[2])
            argv, count, where = self._server_argv(port), 1, f"on port {port}"
        self.output.error(
            f"{child.name} ended ({describe(child.returncode)}); "
            f"starting it again {where} (restart {self._restarts} of "
            f"{c.restart_servers})"
        )
        server = self._child(child.name, argv, dict(os.environ))
        self.servers[i] = server
        self._await_ready(
            server, count, time.monotonic() + SERVER_START_TIMEOUT
        )

    def _await_ready(
        self, server: process.Child, count: int, deadline: float
    ) -> list[str]:
        """Returns the `count` addresses `server` prints, or raises
        LaunchError."""
        try:
            return process.server_addresses(
                server, count, deadline, self._check_signal
            )
        except process.ChildExited:
            raise LaunchError(
                f"{server.name} ended ({describe(server.returncode)}) before "
                "it was ready; its output is above"
            ) from None
        except process.StdoutClosed:
            raise LaunchError(
                f"{server.name} closed its stdout without printing "
                f"a {READY_PREFIX.strip()!r} line"
            ) from None
        except TimeoutError:
            raise LaunchError(
                f"{server.name} printed no {READY_PREFIX.strip()!r} line "
                f"within {SERVER_START_TIMEOUT:g} s; its output, if any, "
                "is above"
            ) from None

    def _start_workers(self, addresses: list[str]) -> None:
        if self.config.hosts is not None:
            env = dict(os.environ)
            for label, argv in self.commands()[self.config.servers :]:
                self.workers.append(self._child(label, argv, env))
            return
        env = dict(os.environ)
        env.update(self.config.worker_env)
        env["JAXPS_SERVERS"] = ",".join(addresses)
        env.setdefault("PYTHONUNBUFFERED", "1")
        for rank in range(self.config.workers):
            env["JAXPS_WORKER_RANK"] = str(rank)
            devices = self.config.worker_devices(rank)
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = devices
                self.output.line(
                    self.output.out,
                    f"jaxps-launch: worker {rank}: CUDA_VISIBLE_DEVICES="
                    f"{devices}",
                )
            self.workers.append(
                self._child(f"worker {rank}", self.config.command, dict(env))
            )

    def _watch(self) -> int:
        """Waits for the workers; returns 0 or the first failure's code."""
        running = set(self.workers)
        failed: list[process.Child] = []
        while running:
            self._check_signal()
            try:
                kind, child = self.events.get(timeout=_TICK)
            except queue.Empty:
                continue
            if kind != "exit":
                continue
            if child in self.servers:
                if self._restarts < self.config.restart_servers:
                    self._restart(child)
                    continue
                raise LaunchError(
                    f"{child.name} ended ({describe(child.returncode)}) "
                    "while workers were running; stopping all processes"
                )
            running.discard(child)
            if child.returncode != 0 and self.config.elastic:
                failed.append(child)
                self.output.error(
                    f"{child.name} failed ({describe(child.returncode)}); "
                    f"{len(running)} worker(s) go on (--elastic)"
                )
            elif child.returncode != 0:
                raise LaunchError(
                    f"{child.name} failed ({describe(child.returncode)}); "
                    "stopping all processes",
                    exit_code(child.returncode),
                )
        if failed and len(failed) == len(self.workers):
            raise LaunchError(
                "every worker failed", exit_code(failed[0].returncode)
            )
        return 0

    def stop(self) -> None:
        """Stops every child: SIGTERM, then SIGKILL after `STOP_GRACE` s.

        A second signal to the launcher cuts the grace short.
        """
        signals_seen = len(self.signals)
        survivors = process.stop_all(
            self.workers + self.servers,
            STOP_GRACE,
            interrupted=lambda: len(self.signals) != signals_seen,
        )
        for child in survivors:
            self.output.error(
                f"{child.name} (pid {child.proc.pid}) survived SIGKILL"
            )


def _install_handlers(handler: Callable[..., None]) -> dict[int, Any]:
    """Installs `handler` for SIGINT and SIGTERM; returns the old ones."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {
        sig: signal.signal(sig, handler)
        for sig in (signal.SIGINT, signal.SIGTERM)
    }


def _restore_handlers(old: dict[int, Any]) -> None:
    for sig, handler in old.items():
        signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """Runs ``jaxps-launch``.

    Args:
      argv: the arguments after the program name (default ``sys.argv[1:]``).

    Returns:
      The exit code: 0 when every worker succeeded, else the first failed
      worker's code, 1 for a server failure, 130 after SIGINT, 143 after
      SIGTERM.
    """
    config = parse_args(argv)
    if config.ray is not None:
        from jaxps._src.launch import ray

        return ray.run_command(config.command, config.ray, config.ray_address)
    launcher = Launcher(config)
    if config.dry_run:
        hostfile.print_commands(launcher.commands())
        return 0
    old = _install_handlers(launcher.on_signal)
    try:
        return launcher.run()
    finally:
        _restore_handlers(old)


if __name__ == "__main__":
    sys.exit(main())
