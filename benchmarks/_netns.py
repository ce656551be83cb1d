"""Network namespaces and child processes for ``benchmarks/cluster.py``.

The emulated cluster is a star: one namespace per host (``<prefix>w0``, ...
for workers, ``<prefix>s0``, ... for servers) and one hub namespace holding
a Linux bridge. Each host has one veth link, ``eth0`` on its side and a port
of the bridge on the hub's side; nothing is created in the root namespace.
Both ends of every veth shape their egress with a token bucket (``tbf``), so
each host can send and receive at the link rate at the same time, like a
full-duplex NIC on a non-blocking switch. Traffic between processes of one
host (a worker and its colocated server) goes over that host's loopback,
unshaped.

Addresses come from 10.231.0.0/24; no namespace has a default route, so no
packet can leave the cluster. All names start with ``jxb-``; `cleanup`
removes every such namespace (and kills the processes still in it).

Usage (as root):

    with Cluster(num_workers=4, num_servers=2, rate_mbit=100) as cluster:
        proc = Proc("w0", cluster.workers[0].ns, ["python", ...], log_dir)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

from jaxps._src.launch import process

PREFIX = "jxb-"
SUBNET = "10.231.0"  # the /24 used only inside the namespaces
PREFIX_LEN = 24
WORKER_BASE = 11  # w<i> is 10.231.0.<11 + i>
SERVER_BASE = 111  # s<i> is 10.231.0.<111 + i>
MAX_HOSTS = 99
TBF_LATENCY_MS = 50  # queue of a link: 50 ms at the link rate, plus burst
BRIDGE = "br0"
QDISCS = ("tbf", "htb")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The parent's environment without JAXPS_* and XLA_FLAGS, plus extra."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("JAXPS_") and k != "XLA_FLAGS"
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def sh(*argv: str, timeout: float = 20.0, check: bool = True) -> str:
    """Runs a command; returns its stdout, raising with stderr on failure."""
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        if check:
            raise
        return ""
    if check and done.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(argv)}` exited with {done.returncode}: "
            f"{done.stderr.strip()}"
        )
    return done.stdout


def unavailable() -> str | None:
    """Why the cluster cannot be built here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install -y iproute2)"
    try:
        done = subprocess.run(
            ["ip", "netns", "list"],
            capture_output=True,
            text=True,
            timeout=10,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"`ip netns list` failed: {err}"
    if done.returncode != 0:
        return f"`ip netns list` failed: {done.stderr.strip()}"
    return None


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """The network namespaces whose names start with `prefix`."""
    out = sh("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def namespace_pids(ns: str) -> list[int]:
    out = sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace_processes(ns: str, grace: float = 3.0) -> None:
    """SIGTERM to every process in `ns`, SIGKILL to those left after grace."""
    pids = namespace_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = namespace_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def delete_namespace(ns: str) -> None:
    """Kills the processes in `ns`, then deletes it (and its links)."""
    kill_namespace_processes(ns)
    sh("ip", "netns", "del", ns, check=False)


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Deletes every namespace named `prefix`*; returns their names."""
    names = list_namespaces(prefix)
    for ns in names:
        delete_namespace(ns)
    return names


@dataclasses.dataclass(frozen=True)
class Host:
    """One emulated machine: its namespace, address and hub-side port."""

    role: str  # "w0", "s1", ...
    ns: str
    ip: str

    @property
    def port_name(self) -> str:
        """Name of this host's veth end in the hub namespace."""
        return self.role


class Cluster:
    """Worker and server hosts on one bridge, each link shaped to a rate.

    Args:
      num_workers: worker hosts w0, w1, ...
      num_servers: server hosts s0, s1, ...
      rate_mbit: rate of every link, in each direction (10^6 bit/s).
      mtu: MTU of the links.
      queue_ms: queue of each link end (tbf latency), ms at the rate.
      tag: makes the namespace names ``jxb-<tag>-...``; default the pid, so
        two runs never share namespaces.
    """

    def __init__(
        self,
        num_workers: int,
        num_servers: int,
        rate_mbit: float,
        *,
        mtu: int = 1500,
        queue_ms: float = TBF_LATENCY_MS,
        qdisc: str = "tbf",
        sysctls: dict[str, str] | None = None,
        tag: str | None = None,
    ):
        if qdisc not in QDISCS:
            raise ValueError(f"qdisc must be one of {QDISCS}, got {qdisc!r}")
        if not 1 <= num_workers <= MAX_HOSTS or not (
            0 <= num_servers <= MAX_HOSTS
        ):
            raise ValueError(
                f"need 1..{MAX_HOSTS} workers and 0..{MAX_HOSTS} servers, got "
                f"{num_workers} and {num_servers}"
            )
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        tag = str(os.getpid()) if tag is None else tag
        self.prefix = f"{PREFIX}{tag}-"
        self.hub = f"{self.prefix}hub"
        self.rate_mbit = rate_mbit
        self.mtu = mtu
        self.queue_ms = queue_ms
        self.qdisc = qdisc
        self.sysctls = dict(sysctls or {})
        self.workers = [
            Host(f"w{i}", f"{self.prefix}w{i}", f"{SUBNET}.{WORKER_BASE + i}")
            for i in range(num_workers)
        ]
        self.servers = [
            Host(f"s{i}", f"{self.prefix}s{i}", f"{SUBNET}.{SERVER_BASE + i}")
            for i in range(num_servers)
        ]
        self._created: list[str] = []

    @property
    def hosts(self) -> list[Host]:
        return self.workers + self.servers

    @property
    def rate_bytes(self) -> float:
        """Link rate in bytes/s."""
        return self.rate_mbit * 1e6 / 8

    @property
    def burst_bytes(self) -> int:
        """Token bucket size: >= 2 GSO packets (64 KiB), >= 4 ms of rate.

        A bucket smaller than a GSO packet would make tbf segment every
        packet in software; 128 KiB is 10 ms at 100 Mbit/s, negligible next
        to transfers of seconds.
        """
        return max(2 * 65536, int(self.rate_bytes * 0.004))

    def tbf_args(self) -> list[str]:
        return [
            "tbf",
            "rate",
            f"{self.rate_mbit:g}mbit",
            "burst",
            str(self.burst_bytes),
            "latency",
            f"{self.queue_ms:g}ms",
        ]

    def up(self) -> None:
        """Creates the namespaces, the bridge, the links and their shaping."""
        self._add_namespace(self.hub)
        sh("ip", "-n", self.hub, "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", BRIDGE, "up")
        for host in self.hosts:
            self._add_namespace(host.ns)
            # Created in the hub with the peer straight in the host: the root
            # namespace never sees either end.
            sh(
                "ip",
                "-n",
                self.hub,
                "link",
                "add",
                host.port_name,
                "mtu",
                str(self.mtu),
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "mtu",
                str(self.mtu),
                "netns",
                host.ns,
            )
            sh(
                "ip",
                "-n",
                self.hub,
                "link",
                "set",
                host.port_name,
                "master",
                BRIDGE,
            )
            sh("ip", "-n", self.hub, "link", "set", host.port_name, "up")
            sh(
                "ip",
                "-n",
                host.ns,
                "addr",
                "add",
                f"{host.ip}/{PREFIX_LEN}",
                "dev",
                "eth0",
            )
            sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
            for key, value in self.sysctls.items():
                sh(
                    "ip",
                    "netns",
                    "exec",
                    host.ns,
                    "sysctl",
                    "-qw",
                    f"{key}={value}",
                )
            # Egress of both ends: host -> switch and switch -> host.
            self.shape(host.ns, "eth0")
            self.shape(self.hub, host.port_name)

    def set_rate(self, rate_mbit: float) -> None:
        """Shapes every link to `rate_mbit` from now on (the qdiscs are
        replaced in place; connections stay)."""
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        if self.qdisc != "tbf":  # htb's classes would be added twice
            raise ValueError("set_rate shapes tbf links only")
        if rate_mbit == self.rate_mbit:
            return
        self.rate_mbit = rate_mbit
        for host in self.hosts:
            self.shape(host.ns, "eth0")
            self.shape(self.hub, host.port_name)

    def shape(self, ns: str, dev: str) -> None:
        """Limits the egress of `dev` in `ns` to the link rate."""
        if self.qdisc == "tbf":
            sh(
                "tc",
                "-n",
                ns,
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                *self.tbf_args(),
            )
            return
        # htb: one class at the rate, split into a class for packets under
        # 128 bytes (pure ACKs, HTTP/2 control frames) served first and one
        # for the rest, with a FIFO of queue_ms. It stands in for the
        # sparse-flow priority of fq_codel (not in this kernel): without it
        # the ACKs of one direction queue behind the data of the other.
        rate = f"{self.rate_mbit:g}mbit"
        burst = str(self.burst_bytes)
        tc = ["tc", "-n", ns]
        sh(
            *tc,
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "handle",
            "1:",
            "htb",
            "default",
            "20",
        )
        sh(
            *tc,
            "class",
            "add",
            "dev",
            dev,
            "parent",
            "1:",
            "classid",
            "1:1",
            "htb",
            "rate",
            rate,
            "burst",
            burst,
            "cburst",
            burst,
        )
        for classid, prio, share in (("1:10", "0", 0.05), ("1:20", "1", 0.95)):
            sh(
                *tc,
                "class",
                "add",
                "dev",
                dev,
                "parent",
                "1:1",
                "classid",
                classid,
                "htb",
                "rate",
                f"{self.rate_mbit * share:g}mbit",
                "ceil",
                rate,
                "prio",
                prio,
                "burst",
                burst,
                "cburst",
                burst,
            )
        limit = int(self.rate_bytes * self.queue_ms / 1000) + self.burst_bytes
        sh(
            *tc,
            "qdisc",
            "add",
            "dev",
            dev,
            "parent",
            "1:20",
            "bfifo",
            "limit",
            str(limit),
        )
        # IPv4 total length (bytes 2-3 of the header) < 128.
        sh(
            *tc,
            "filter",
            "add",
            "dev",
            dev,
            "parent",
            "1:",
            "protocol",
            "ip",
            "prio",
            "1",
            "u32",
            "match",
            "u16",
            "0x0000",
            "0xff80",
            "at",
            "2",
            "flowid",
            "1:10",
        )

    def _add_namespace(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self._created.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def shaping(self) -> str:
        """The qdiscs and classes of a host's link end, for the report."""
        host = self.hosts[0]
        out = sh("tc", "-n", host.ns, "qdisc", "show", "dev", "eth0")
        if self.qdisc != "tbf":
            out += sh("tc", "-n", host.ns, "class", "show", "dev", "eth0")
        return " ".join(out.split())

    def down(self) -> None:
        """Kills what runs in the namespaces and deletes them; idempotent."""
        while self._created:
            delete_namespace(self._created.pop())

    def __enter__(self) -> Cluster:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()


# -- child processes ----------------------------------------------------------

_live: set[Proc] = set()


class Proc(process.Child):
    """A child process in network namespace `ns` (None: the current one).

    Its stdout and stderr go to files in `log_dir`, in which it runs, so that
    it can never block on a full pipe; `env` is its whole environment (see
    `child_env`). `stop_all` stops every `Proc` not stopped yet.
    """

    def __init__(
        self,
        name: str,
        ns: str | None,
        argv: Sequence[str],
        log_dir: str,
        env: dict[str, str] | None = None,
    ):
        super().__init__(
            name, argv, env=env, cwd=log_dir, netns=ns, log_dir=log_dir
        )
        _live.add(self)

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM to the child's process group, SIGKILL after `grace` s."""
        super().stop(grace)
        _live.discard(self)


def stop_all() -> None:
    """Stops every `Proc` not stopped yet."""
    process.stop_all(list(_live), 3.0)
    _live.clear()
