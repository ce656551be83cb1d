"""Launching a job on several machines over ssh, from a hostfile.

A hostfile names one host per line, with its role::

    # CPU machines that only sum
    server cpu1:9000
    server cpu2          # port 9000
    server cpu3 processes=4   # 4 server processes, ports 9000..9003
    # training machines, in rank order
    worker gpu1
    worker gpu2

`ssh_commands` turns it into the ssh command lines of every server and
worker; ``jaxps-launch --hostfile FILE --dry-run -- CMD`` prints them and
``jaxps-launch --hostfile FILE -- CMD`` runs them (ssh with key-based login,
jaxps installed on every host and the same working directory everywhere).
Each server binds the address its hostfile name resolves to on its machine.
A server line with ``processes=P`` runs ``jaxps-server --processes P``
there: P processes on ports PORT..PORT+P-1, all in the workers'
``JAXPS_SERVERS`` (the plan counts them as one host).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys

DEFAULT_PORT = 9000


class HostfileError(ValueError):
    """A hostfile line is not ``server HOST[:PORT] [processes=P]`` or
    ``worker HOST``."""


@dataclasses.dataclass(frozen=True)
class Hosts:
    """The servers (``host:port``) and worker hosts (rank order) of a job.

    ``processes[i]`` is the number of server processes of ``servers[i]``
    (on its port and the ones after it); empty means 1 each.
    """

    servers: tuple[str, ...]
    workers: tuple[str, ...]
    processes: tuple[int, ...] = ()

    def counts(self) -> tuple[int, ...]:
        """The number of processes of each server line."""
        return self.processes or (1,) * len(self.servers)

    def addresses(self) -> tuple[str, ...]:
        """``host:port`` of every server process, line after line."""
        out = []
        for server, count in zip(self.servers, self.counts()):
            host, port = server.rsplit(":", 1)
            out += [f"{host}:{int(port) + i}" for i in range(count)]
        return tuple(out)


_EXPECTED = "expected 'server HOST[:PORT] [processes=P]' or 'worker HOST'"


def parse_hostfile(
    text: str, source: str = "hostfile", processes: int = 1
) -> Hosts:
    """Parses a hostfile; errors name the line.

    Args:
      text: the hostfile.
      source: its name in errors.
      processes: the processes of a server line without ``processes=``.
    """
    servers, counts, workers = [], [], []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        parts = line.split()
        role = parts[0]
        if role == "worker" and len(parts) == 2:
            workers.append(parts[1])
            continue
        if role != "server" or len(parts) not in (2, 3):
            raise HostfileError(f"{where}: {_EXPECTED}, got {raw.strip()!r}")
        host, count = parts[1], processes
        if len(parts) == 3:
            count = _processes(parts[2], where)
        name, sep, port = host.rpartition(":")
        if not sep:
            name, port = host, str(DEFAULT_PORT)
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise HostfileError(f"{where}: bad server {host!r}")
        if int(port) + count - 1 > 65535:
            raise HostfileError(
                f"{where}: server {host!r} with processes={count} needs "
                f"ports up to {int(port) + count - 1} > 65535"
            )
        servers.append(f"{name}:{port}")
        counts.append(count)
    if not workers:
        raise HostfileError(f"{source}: no 'worker HOST' line")
    hosts = Hosts(tuple(servers), tuple(workers), tuple(counts))
    every = hosts.addresses()
    if len(set(every)) != len(every):
        twice = sorted({a for a in every if every.count(a) > 1})
        raise HostfileError(f"{source}: a server is listed twice: {twice}")
    return hosts


def _processes(text: str, where: str) -> int:
    key, sep, value = text.partition("=")
    if key != "processes" or not sep or not value.isdigit() or int(value) < 1:
        raise HostfileError(
            f"{where}: expected processes=P with P >= 1, got {text!r}"
        )
    return int(value)


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
    processes: int = 1,
) -> list[str]:
    """The ssh command line that runs one server (of `processes`)."""
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
        *(("--processes", str(processes)) if processes > 1 else ()),
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
                processes=p,
            ),
        )
        for i, (a, p) in enumerate(zip(hosts.servers, hosts.counts()))
    ]
    for rank, host in enumerate(hosts.workers):
        env = dict(worker_env or {})
        env.update(
            JAXPS_SERVERS=",".join(hosts.addresses()),
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
