"""Launching a job on several machines over ssh, from a hostfile.

A hostfile names one host per line, with its role::

    # CPU machines that only sum
    server cpu1:9000
    server cpu2          # port 9000
    # training machines, in rank order
    worker gpu1
    worker gpu2

`ssh_commands` turns it into the ssh command lines of every server and
worker; ``jaxps-launch --hostfile FILE --dry-run -- CMD`` prints them and
``jaxps-launch --hostfile FILE -- CMD`` runs them (ssh with key-based login,
jaxps installed on every host and the same working directory everywhere).
Each server binds the address its hostfile name resolves to on its machine.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys

DEFAULT_PORT = 9000


class HostfileError(ValueError):
    """A hostfile line is not ``server HOST[:PORT]`` or ``worker HOST``."""


@dataclasses.dataclass(frozen=True)
class Hosts:
    """The servers (``host:port``) and worker hosts (rank order) of a job."""

    servers: tuple[str, ...]
    workers: tuple[str, ...]


def parse_hostfile(text: str, source: str = "hostfile") -> Hosts:
    """Parses a hostfile; errors name the line."""
    servers, workers = [], []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or parts[0] not in ("server", "worker"):
            raise HostfileError(
                f"{source}:{number}: expected 'server HOST[:PORT]' or "
                f"'worker HOST', got {raw.strip()!r}"
            )
        role, host = parts
        if role == "worker":
            workers.append(host)
            continue
        name, sep, port = host.rpartition(":")
        if not sep:
            name, port = host, str(DEFAULT_PORT)
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise HostfileError(f"{source}:{number}: bad server {host!r}")
        servers.append(f"{name}:{port}")
    if not workers:
        raise HostfileError(f"{source}: no 'worker HOST' line")
    if len(set(servers)) != len(servers):
        raise HostfileError(f"{source}: a server is listed twice")
    return Hosts(tuple(servers), tuple(workers))


def _ssh(host: str, remote: str) -> list[str]:
    """ssh argv running the shell command line `remote` on `host`."""
    # -tt: the remote side ends when the ssh client is stopped
    return ["ssh", "-o", "BatchMode=yes", "-tt", host, remote]


def server_command(
    address: str,
    *,
    num_workers: int,
    job_id: str,
    timeout: float,
    flags: tuple[str, ...] = (),
) -> list[str]:
    """The ssh command line that runs one server."""
    host, port = address.rsplit(":", 1)
    remote = [
        "jaxps-server",
        "--host",
        host,
        "--port",
        port,
        "--num-workers",
        str(num_workers),
        "--job-id",
        job_id,
        "--round-timeout",
        str(timeout),
        *flags,
    ]
    return _ssh(host, shlex.join(remote))


def worker_command(
    host: str, command: list[str], env: dict[str, str], cwd: str
) -> list[str]:
    """The ssh command line that runs one worker with its JAXPS_* env."""
    remote = ["cd", cwd, "&&", "env"]
    remote += [f"{k}={v}" for k, v in sorted(env.items())]
    remote += command
    quoted = " ".join(a if a == "&&" else shlex.quote(a) for a in remote)
    return _ssh(host, quoted)


def ssh_commands(
    hosts: Hosts,
    command: list[str],
    *,
    job_id: str,
    timeout: float,
    server_flags: tuple[str, ...] = (),
    worker_env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> list[tuple[str, list[str]]]:
    """(label, argv) of every server, then every worker in rank order."""
    cwd = cwd or os.getcwd()
    n = len(hosts.workers)
    out = [
        (
            f"server {i}",
            server_command(
                a,
                num_workers=n,
                job_id=job_id,
                timeout=timeout,
                flags=server_flags,
            ),
        )
        for i, a in enumerate(hosts.servers)
    ]
    for rank, host in enumerate(hosts.workers):
        env = dict(worker_env or {})
        env.update(
            JAXPS_SERVERS=",".join(hosts.servers),
            JAXPS_NUM_WORKERS=str(n),
            JAXPS_WORKER_RANK=str(rank),
            JAXPS_JOB_ID=job_id,
        )
        out.append((f"worker {rank}", worker_command(host, command, env, cwd)))
    return out


def print_commands(commands, out=None) -> None:
    """Prints ``label: command`` lines, shell-quoted."""
    out = out or sys.stdout
    for label, argv in commands:
        print(f"{label}: {shlex.join(argv)}", file=out)
