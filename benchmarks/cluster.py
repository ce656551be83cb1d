"""jaxps on an emulated cluster: rate-limited links between namespaces.

Run as root from the repository root:

    python benchmarks/cluster.py [--quick] [--rate-mbit 100]
        [--mb 25] [--repeats 3] [--configs "4,0;4,2;4,4"]
        [--server-processes P]
    python benchmarks/cluster.py --cleanup

n worker hosts and k server hosts are network namespaces joined by veth
links to a bridge in a hub namespace; both ends of every link are shaped to
``--rate-mbit`` with tbf (see ``_netns.py``). For each (n, k) of
``--configs`` it measures one ``push_pull`` of M bytes of float32
(``--mb``, 10^6 bytes) and compares it with:

* t_opt = 2n(n-1)M / ((n^2+kn-2k) B), the BytePS optimum, B the link rate
  in bytes/s (`jaxps.optimal_time`);
* plan: the same bound for jaxps' actual chunk-to-server assignment (the
  busiest link's bytes / B), which shows what the chunk size costs;
* ring: a ring all-reduce of the same array with gloo (``jax.distributed``
  with n processes of one CPU device, a jitted psum), in the worker
  namespaces; run once per n;
* plain PS: jaxps with the k CPU servers only, no colocated servers;
* with ``--tls``: jaxps mixed mode again with every server on TLS (the data
  channel too; a self-signed certificate for the run), against plaintext;
* with ``--tuned``: jaxps mixed mode again with a hand-tuned partition of
  2 ms of link time (24 KiB at 100 Mbit/s, 244 KiB at 1 Gbit/s), against
  the main row.

jaxps mixed mode runs k CPU servers (``python -m jaxps.servers``) in the
server namespaces and one colocated server in each worker namespace. With
``--server-processes P`` each CPU server is ``jaxps-server --processes P``
(ports BASE..BASE+P-1, all in JAXPS_SERVERS; the plan counts the P
processes of a namespace as one host, and so does the plan column). Every
timed repetition starts with a barrier (a 4-byte push_pull), its time is the
slowest worker's, and the table shows the median over ``--repeats`` after
one warm-up. jaxps runs with its own defaults (``partition_bytes="auto"``:
the workers measure the links at init and pick the partition, and the
credit follows it) unless ``--partition-kib`` or ``--credit-kib`` set them.
Larger chunks pipeline too coarsely (each waits for its whole push before
its pull), smaller ones cost CPU per chunk (the sweep across link rates is
in benchmarks/README.md). Links
have an MTU of 9000 (``--mtu``): at 1500 the headers alone cost 4.4% of
every link, which the formula does not count; the ring runs on the same
links.
``--cleanup`` deletes leftover ``jxb-`` namespaces of a killed run (a normal
run always deletes its own). Results and their analysis: "Emulated cluster"
in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import _netns
from _netns import Proc, child_env

from jaxps._src.launch.process import server_addresses, server_argv, wait_all

RESULT = "RESULT "
READY = "READY"
DEFAULTS = {"mb": 25.0, "repeats": 5, "configs": "4,0;4,2;4,4"}
QUICK = {"mb": 4.0, "repeats": 1, "configs": "4,2"}
BASE_PORT = 9000
SERVER_START_TIMEOUT = 90.0
JAXPS_TIMEOUT = 120  # JAXPS_TIMEOUT of the workers, --round-timeout
#: The hand-tuned partition of ``--tuned``: this much link time (2 ms:
#: 24 KiB at 100 Mbit/s).
PARTITION_SECONDS = 0.002
GOODPUT_BYTES = 8_000_000
GOODPUT_SKIP = 1_000_000  # excluded from the goodput: the tbf burst


def log(message: str) -> None:
    """Progress goes to stderr; stdout carries the results."""
    print(message, file=sys.stderr, flush=True)


# -- child processes (run inside the namespaces) -----------------------------


def report(result: dict) -> None:
    print(RESULT + json.dumps(result), flush=True)


def child_jaxps(args) -> int:
    """A jaxps worker: a barrier, then one timed push_pull, repeated."""
    import numpy as np

    import jaxps

    settings = {}
    if args.credit_bytes:
        settings["credit_bytes"] = args.credit_bytes
    jaxps.init(**settings)  # the others from the JAXPS_* variables
    n, rank = jaxps.size(), jaxps.rank()
    x = np.ones(args.elements, np.float32) * (rank + 1)
    expected = n * (n + 1) // 2
    tick = np.ones(1, np.float32)
    starts, ends = [], []
    try:
        for rep in range(args.repeats + 1):
            got = jaxps.push_pull_numpy("barrier", tick, average=False)
            assert got[0] == n, f"barrier sum {got[0]} != {n}"
            starts.append(time.monotonic())
            y = jaxps.push_pull_numpy("x", x, average=False)
            ends.append(time.monotonic())
            if not np.all(y == expected):
                bad = int(np.count_nonzero(y != expected))
                raise AssertionError(
                    f"rank {rank} repetition {rep}: {bad} of {y.size} "
                    f"elements differ from {expected}"
                )
        from jaxps._src import state

        partition = state.runtime().partition_bytes
        tuned = state.runtime().tuned
    finally:
        jaxps.shutdown()
    report(
        {
            "rank": rank,
            "starts": starts,
            "ends": ends,
            "partition": partition,
            "tuned": tuned and tuned._asdict(),
        }
    )
    return 0


def _bind_gloo(ip: str) -> None:
    """Makes gloo listen on (and advertise) `ip`.

    By default gloo resolves the machine's hostname, which is shared by all
    namespaces and maps to 127.0.0.1 here: each process would tell its peers
    to connect to their own loopback.
    """
    from jax._src import xla_bridge

    make = xla_bridge._jax.make_gloo_tcp_collectives

    def make_on_ip(distributed_client, hostname=None, interface=None):
        return make(distributed_client=distributed_client, hostname=ip)

    xla_bridge._jax.make_gloo_tcp_collectives = make_on_ip


def child_gloo(args) -> int:
    """A ring all-reduce worker: jitted psum over one CPU device/process."""
    import jax
    import numpy as np

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _bind_gloo(args.my_ip)
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        coordinator_bind_address=args.coordinator,
        num_processes=args.num_workers,
        process_id=args.rank,
        initialization_timeout=JAXPS_TIMEOUT,
        shutdown_timeout_seconds=60,
    )
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = args.num_workers
    devices = jax.devices()
    assert len(devices) == n, f"{len(devices)} global devices, want {n}"
    mesh = Mesh(np.array(devices), ("x",))
    psum = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(v, "x"),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P(),
        )
    )
    (device,) = jax.local_devices()
    local = np.ones(args.elements, np.float32) * (args.rank + 1)
    x = jax.make_array_from_single_device_arrays(
        (n * args.elements,),
        NamedSharding(mesh, P("x")),
        [jax.device_put(local, device)],
    )
    expected = n * (n + 1) // 2
    starts, ends = [], []
    for rep in range(args.repeats + 1):
        multihost_utils.sync_global_devices(f"rep{rep}")
        starts.append(time.monotonic())
        y = psum(x).block_until_ready()
        ends.append(time.monotonic())
        got = np.asarray(y.addressable_shards[0].data)
        if not np.all(got == expected):
            raise AssertionError(f"psum on rank {args.rank} is wrong")
    multihost_utils.sync_global_devices("done")
    jax.distributed.shutdown()
    report({"rank": args.rank, "starts": starts, "ends": ends})
    return 0


def child_sink(args) -> int:
    """Receives --bytes on one TCP connection; reports the goodput."""
    with socket.create_server((args.my_ip, args.port)) as server:
        server.settimeout(30)
        print(READY, flush=True)
        conn, _ = server.accept()
    with conn:
        conn.settimeout(30)
        got, mark = 0, None
        buf = bytearray(1 << 20)
        while got < args.bytes:
            count = conn.recv_into(buf)
            if count == 0:
                break
            got += count
            if mark is None and got >= GOODPUT_SKIP:
                mark, marked = time.monotonic(), got
        end = time.monotonic()
    if got < args.bytes or mark is None or end <= mark:
        raise RuntimeError(f"received {got} of {args.bytes} bytes")
    report({"mbit": (got - marked) * 8 / (end - mark) / 1e6})
    return 0


def child_source(args) -> int:
    """Sends --bytes to --connect host:port."""
    host, port = args.connect.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=30)
    with conn:
        block = b"\0" * (1 << 20)
        sent = 0
        while sent < args.bytes:
            part = block[: min(len(block), args.bytes - sent)]
            conn.sendall(part)
            sent += len(part)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # the sink closes when it has everything
    return 0


CHILDREN = {
    "jaxps": child_jaxps,
    "gloo": child_gloo,
    "sink": child_sink,
    "source": child_source,
}


# -- the parent: builds the cluster, starts the children, reports ----------


def child_argv(role: str, *extra: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--child", role, *extra]


def results(procs: list[Proc]) -> list[dict]:
    out = []
    for proc in procs:
        line = None
        for text in proc.stdout().splitlines():
            if text.startswith(RESULT):
                line = text[len(RESULT) :]
        if line is None:
            raise RuntimeError(f"{proc.name} printed no result")
        out.append(json.loads(line))
    return out


def slowest(per_worker: list[dict]) -> tuple[list[float], list[float]]:
    """Per repetition (warm-up dropped): the slowest worker's time, and the
    span from the first start to the last end."""
    reps = len(per_worker[0]["starts"])
    worst, span = [], []
    for r in range(1, reps):
        worst.append(max(w["ends"][r] - w["starts"][r] for w in per_worker))
        span.append(
            max(w["ends"][r] for w in per_worker)
            - min(w["starts"][r] for w in per_worker)
        )
    return worst, span


class Bench:
    """The runs of one benchmark invocation on one cluster."""

    def __init__(self, cluster: _netns.Cluster, args, log_dir: str):
        self.cluster = cluster
        self.args = args
        self.log_dir = log_dir
        #: (certificate, key) of the TLS runs, or None
        self.tls: tuple[str, str] | None = None
        self.model_bytes = args.elements * 4
        self.port = BASE_PORT
        self.run_timeout = 120.0 + (args.repeats + 1) * 20.0 * (
            self.model_bytes / cluster.rate_bytes
        )

    def next_port(self, count: int = 1) -> int:
        """The first of `count` ports no run has used yet."""
        # A fresh port for every run: a dying server of the previous run can
        # never share (SO_REUSEPORT) the port of the next one.
        self.port += count
        return self.port - count + 1

    def goodput(self) -> float:
        """Mbit/s of one TCP stream w0 -> w1 (or w0 -> s0)."""
        hosts = self.cluster.hosts
        src, dst = hosts[0], hosts[1]
        port = self.next_port()
        size = str(GOODPUT_BYTES)
        sink = Proc(
            "goodput-sink",
            dst.ns,
            child_argv(
                "sink",
                "--my-ip",
                dst.ip,
                "--port",
                str(port),
                "--bytes",
                size,
            ),
            self.log_dir,
            child_env(),
        )
        try:
            sink.wait_for_line(READY, time.monotonic() + 30)
            source = Proc(
                "goodput-source",
                src.ns,
                child_argv(
                    "source",
                    "--connect",
                    f"{dst.ip}:{port}",
                    "--bytes",
                    size,
                ),
                self.log_dir,
                child_env(),
            )
            try:
                wait_all([sink, source], time.monotonic() + 60)
            finally:
                source.stop()
        finally:
            sink.stop()
        return results([sink])[0]["mbit"]

    def jaxps(
        self,
        n: int,
        k: int,
        colocated: bool,
        tls: bool = False,
        tuned: bool = False,
    ) -> dict:
        """One jaxps run: k CPU servers (+ n colocated), n workers; `tls`:
        every server and worker on TLS (`self.tls`: certificate, key);
        `tuned`: the hand-tuned partition (`tuned_partition`) instead of
        ``--partition-kib`` or jaxps' own."""
        label = f"{'mixed' if colocated else 'plain'}-{n}-{k}"
        label += "-tls" if tls else ""
        label += "-tuned" if tuned else ""
        partition = (
            tuned_partition(self.args.rate_mbit)
            if tuned
            else self.args.partition_bytes
        )
        tls_flags: tuple[str, ...] = ()
        if tls:
            tls_flags = ("--tls-cert", self.tls[0], "--tls-key", self.tls[1])
        procs = self.args.server_processes
        port = self.next_port(procs)
        placed = [
            (h, f"{label}-server-{h.role}", procs)
            for h in self.cluster.servers[:k]
        ]
        if colocated:
            placed += [
                (h, f"{label}-coloc-{h.role}", 1)
                for h in self.cluster.workers[:n]
            ]
        servers, workers = [], []
        try:
            for host, name, count in placed:
                argv = server_argv(
                    n,
                    "--round-timeout",
                    str(JAXPS_TIMEOUT),
                    *(("--processes", str(count)) if count > 1 else ()),
                    *tls_flags,
                    host=host.ip,
                    port=port,
                )
                servers.append(
                    Proc(name, host.ns, argv, self.log_dir, child_env())
                )
            deadline = time.monotonic() + SERVER_START_TIMEOUT
            for proc, (_, _, count) in zip(servers, placed):
                server_addresses(proc, count, deadline)
            cpu = [
                f"{h.ip}:{port + i}"
                for h in self.cluster.servers[:k]
                for i in range(procs)
            ]
            coloc = [
                f"{h.ip}:{port}" for h in self.cluster.workers[:n] if colocated
            ]
            for rank, host in enumerate(self.cluster.workers[:n]):
                env = child_env(
                    {
                        "JAXPS_SERVERS": ",".join(cpu),
                        "JAXPS_COLOCATED_SERVERS": ",".join(coloc),
                        "JAXPS_NUM_WORKERS": str(n),
                        "JAXPS_WORKER_RANK": str(rank),
                        "JAXPS_TIMEOUT": str(JAXPS_TIMEOUT),
                        "JAXPS_JOB_ID": label,
                        "JAXPS_TRANSPORT": self.args.transport,
                        **({"JAXPS_TLS_CA": self.tls[0]} if tls else {}),
                        **(
                            {"JAXPS_PARTITION_BYTES": str(partition)}
                            if partition
                            else {}
                        ),
                    }
                )
                argv = child_argv(
                    "jaxps",
                    "--elements",
                    str(self.args.elements),
                    "--repeats",
                    str(self.args.repeats),
                    "--credit-bytes",
                    str(self.args.credit_bytes),
                )
                workers.append(
                    Proc(
                        f"{label}-worker-{host.role}",
                        host.ns,
                        argv,
                        self.log_dir,
                        env,
                    )
                )
            wait_all(workers, time.monotonic() + self.run_timeout)
        finally:
            for proc in workers + servers:
                proc.stop()
            _warn_dropped_connections(servers + workers)
        per_worker = results(workers)
        worst, span = slowest(per_worker)
        return {"times": worst, "spans": span, "workers": per_worker}

    def ring(self, n: int) -> dict:
        """One gloo ring all-reduce run over the first n worker hosts."""
        port = self.next_port()
        coordinator = f"{self.cluster.workers[0].ip}:{port}"
        workers = []
        try:
            for rank, host in enumerate(self.cluster.workers[:n]):
                argv = child_argv(
                    "gloo",
                    "--rank",
                    str(rank),
                    "--num-workers",
                    str(n),
                    "--coordinator",
                    coordinator,
                    "--my-ip",
                    host.ip,
                    "--elements",
                    str(self.args.elements),
                    "--repeats",
                    str(self.args.repeats),
                )
                workers.append(
                    Proc(
                        f"ring-{n}-{host.role}",
                        host.ns,
                        argv,
                        self.log_dir,
                        child_env(),
                    )
                )
            wait_all(workers, time.monotonic() + self.run_timeout)
        finally:
            for proc in workers:
                proc.stop()
        per_worker = results(workers)
        worst, span = slowest(per_worker)
        return {"times": worst, "spans": span, "workers": per_worker}


def _warn_dropped_connections(procs: list[Proc]) -> None:
    """Logs the gRPC connections that keepalive closed during a run."""
    for proc in procs:
        with open(proc.err_path, errors="replace") as f:
            count = sum("ping_timeout" in line for line in f)
        if count:
            log(
                f"  warning: {proc.name} logged {count} connection(s) "
                "closed by a keepalive ping timeout"
            )


def tuned_partition(rate_mbit: float) -> int:
    """The hand-tuned partition at `rate_mbit`: 2 ms of link time."""
    kib = round(rate_mbit * 1e6 / 8 * PARTITION_SECONDS / 1024)
    return 1024 * max(16, kib)


def chosen_partition(run: dict) -> int:
    """The partition the workers of a jaxps run used (the largest, where
    they differ: none should)."""
    return max(w["partition"] for w in run["workers"])


def plan_link_bytes(
    n: int,
    k: int,
    model_bytes: int,
    partition: int,
    colocated: bool,
    processes: int = 1,
) -> int:
    """Bytes on the busiest host link (each way) for jaxps' chunk
    assignment, with `processes` server processes on each CPU host."""
    from jaxps._src import plan, topology

    cpu = [f"s{j}:{BASE_PORT + i}" for j in range(k) for i in range(processes)]
    coloc = [f"w{w}:{BASE_PORT}" for w in range(n)] if colocated else []
    weights = topology.host_weights(cpu, coloc)  # as the workers compute
    pieces = plan.make_plan(
        ["x"],
        [model_bytes // 4],
        ["<f4"],
        [4],
        [0],
        partition_bytes=partition,
        weights=weights,
        hosts=topology.host_index(cpu, coloc),
    )
    share = [0] * len(weights)
    for piece in pieces:
        share[piece.server] += piece.length * 4
    # CPU host: n pushes in to each of its processes
    links = [n * sum(share[s] for s in g) for g in topology.host_groups(cpu)]
    for w in range(n):  # worker w: its pushes out, its server's pulls out
        local = share[len(cpu) + w] if colocated else 0
        links.append(model_bytes - local + (n - 1) * local)
    return max(links)


def parse_configs(text: str) -> list[tuple[int, int]]:
    configs = []
    for part in text.split(";"):
        if not part.strip():
            continue
        try:
            n, k = (int(v) for v in part.split(","))
        except ValueError:
            raise SystemExit(
                f"--configs: expected 'n,k;n,k;...', got {part!r}"
            ) from None
        if n < 2 or k < 0:
            raise SystemExit(f"--configs: need n >= 2, k >= 0, got {part!r}")
        configs.append((n, k))
    if not configs:
        raise SystemExit("--configs is empty")
    return configs


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


class CpuMeter:
    """CPU seconds used by this process and its children vs the machine.

    The difference is what other processes took while the benchmark ran:
    on a shared machine it tells a disturbed run from a quiet one.
    """

    def __init__(self):
        self.load = os.getloadavg()[0]
        self.wall = time.monotonic()
        self.busy = self._machine_busy()
        self.own = self._own()

    @staticmethod
    def _machine_busy() -> float:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        # user, nice, system: the time charged to processes.
        return sum(fields[:3]) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def summary(self) -> str:
        wall = time.monotonic() - self.wall
        busy = self._machine_busy() - self.busy
        own = self._own() - self.own
        return (
            f"load {self.load:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
            f"in {wall:.0f} s this benchmark used {own:.0f} CPU-s, other "
            f"processes about {max(0.0, busy - own):.0f} CPU-s"
        )


def print_report(args, cluster, goodput, rows, ring, cpu) -> None:
    """The table and the goals, on stdout."""
    import jaxps

    bandwidth = cluster.rate_bytes
    m = args.elements * 4
    partitions = sorted({chosen_partition(r["mixed"]) for r in rows.values()})
    credit = jaxps.Config(  # the workers' credit, by jaxps' own rule
        partition_bytes=partitions[-1],
        credit_bytes=args.credit_bytes or None,
    ).credit_bytes
    how = "set" if args.partition_bytes else "jaxps' own 'auto' chose"
    print(f"\n## jaxps on an emulated cluster ({time.strftime('%Y-%m-%d')})\n")
    print(
        f"machine: {os.cpu_count()} cores, {platform.machine()}, Linux "
        f"{platform.release()}, Python {platform.python_version()}; "
        f"{cpu.summary()}"
    )
    print(
        f"links: {args.rate_mbit:g} Mbit/s each way (tbf burst "
        f"{cluster.burst_bytes} B, latency {cluster.queue_ms:g} ms, MTU "
        f"{cluster.mtu}, {cluster.qdisc}); one TCP stream measured "
        f"{goodput:.1f} Mbit/s of payload"
    )
    print(
        f"M = {m / 1e6:g} MB float32, partition {how} "
        f"{'/'.join(map(str, partitions))} B, credit {credit} B, "
        f"transport {args.transport}, "
        f"{args.server_processes} process(es) per CPU server, "
        f"median of {args.repeats} after 1 warm-up; seconds\n"
    )
    header = [
        "config (n,k)",
        "jaxps",
        "t_opt",
        "jaxps/t_opt",
        "plan bound",
        "ring",
        "speedup vs ring",
        "plain PS",
    ]
    table = []
    for (n, k), row in rows.items():
        t = statistics.median(row["mixed"]["times"])
        topt = jaxps.optimal_time(n, k, m, bandwidth)
        bound = plan_link_bytes(
            n,
            k,
            m,
            chosen_partition(row["mixed"]),
            True,
            args.server_processes,
        )
        r = statistics.median(ring[n]["times"]) if n in ring else None
        plain = row.get("plain")
        table.append(
            [
                f"({n},{k})",
                fmt(t),
                fmt(topt),
                f"{t / topt:.2f}",
                fmt(bound / bandwidth),
                fmt(r),
                "-" if r is None else f"{r / t:.2f}x",
                "-"
                if plain is None
                else fmt(statistics.median(plain["times"])),
            ]
        )
    print(markdown(header, table))
    ideals = [
        f"n={n}: ring ideal 2(n-1)M/(nB) = "
        f"{2 * (n - 1) * m / (n * bandwidth):.2f} s"
        for n in sorted({n for n, _ in rows})
    ]
    ideals += [
        f"n={n},k={k}: plain PS ideal nM/(kB) = {n * m / (k * bandwidth):.2f} s"
        for (n, k) in rows
        if k > 0
    ]
    print("\n" + "; ".join(ideals))
    print("\ngoals:")
    for (n, k), row in rows.items():
        t = statistics.median(row["mixed"]["times"])
        ratio = t / jaxps.optimal_time(n, k, m, bandwidth)
        verdict = "met" if ratio <= 1.10 else "MISSED"
        print(f"- ({n},{k}) within 10% of t_opt: {verdict} ({ratio:.2f}x)")
    at4 = [(n, k) for (n, k) in rows if k == 4 and n in ring]
    if not at4:
        print("- >= 1.4x faster than ring at k=4: n/a (no k=4 config run)")
    for n, k in at4:
        speedup = statistics.median(ring[n]["times"]) / statistics.median(
            rows[(n, k)]["mixed"]["times"]
        )
        verdict = "met" if speedup >= 1.4 else "MISSED"
        print(
            f"- ({n},{k}) >= 1.4x faster than ring: {verdict} ({speedup:.2f}x)"
        )
    at2 = [(n, k) for (n, k) in rows if k == 2]
    if not at2:
        print("- mixed faster than plain PS at k=2: n/a (no k=2 config run)")
    for n, k in at2:
        mixed = statistics.median(rows[(n, k)]["mixed"]["times"])
        if "plain" not in rows[(n, k)]:
            print(f"- ({n},{k}) mixed faster than plain PS: n/a (not run)")
            continue
        plain = statistics.median(rows[(n, k)]["plain"]["times"])
        verdict = "met" if mixed < plain else "MISSED"
        print(
            f"- ({n},{k}) mixed faster than plain PS: {verdict} "
            f"({plain / mixed:.2f}x)"
        )


def markdown(header, rows) -> str:
    widths = [
        max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))
    ]
    lines = []
    for cells in [header, *rows]:
        lines.append(
            "| "
            + " | ".join(
                str(c).ljust(w) if i == 0 else str(c).rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths))
            )
            + " |"
        )
    rule = "|" + "|".join(
        "-" * (w + 2) if i == 0 else "-" * (w + 1) + ":"
        for i, w in enumerate(widths)
    )
    lines.insert(1, rule + "|")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="jaxps push_pull on an emulated cluster of network "
        "namespaces with rate-limited links (needs root).",
    )
    p.add_argument(
        "--rate-mbit",
        type=float,
        default=100.0,
        help="rate of every link, each way (default %(default)s)",
    )
    p.add_argument(
        "--mb",
        type=float,
        default=None,
        help="bytes of the push_pull in 10^6 (default 25)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed repetitions after 1 warm-up (default 5)",
    )
    p.add_argument(
        "--configs",
        default=None,
        help="'n,k;...' workers and CPU servers (default "
        f"{DEFAULTS['configs']!r})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short run: --mb 4 --repeats 1 --configs 4,2 unless given",
    )
    p.add_argument(
        "--partition-kib",
        type=int,
        default=None,
        help="jaxps partition size, KiB (default: jaxps' own, 'auto')",
    )
    p.add_argument(
        "--server-processes",
        type=int,
        default=1,
        metavar="P",
        help="jaxps-server processes per CPU server host, on ports "
        "BASE..BASE+P-1 (default %(default)s)",
    )
    p.add_argument(
        "--credit-kib",
        type=int,
        default=0,
        help="jaxps bytes being pushed at once, to all servers together, "
        "KiB (default: jaxps' own, 4 partitions)",
    )
    p.add_argument(
        "--transport",
        choices=("auto", "tcp", "grpc"),
        default="auto",
        help="JAXPS_TRANSPORT of the workers: auto (jaxps' default, the "
        "data channel to other hosts) or grpc (payloads in gRPC messages)",
    )
    p.add_argument(
        "--queue-ms",
        type=float,
        default=50.0,
        help="tbf queue of each link end, in ms at the link rate "
        "(default %(default)s)",
    )
    p.add_argument(
        "--qdisc",
        choices=_netns.QDISCS,
        default="tbf",
        help="shaping of each link end: tbf (one FIFO) or htb "
        "(small packets first); default %(default)s",
    )
    p.add_argument(
        "--sysctl",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a sysctl set in every host namespace (repeatable), "
        "e.g. net.ipv4.tcp_slow_start_after_idle=0",
    )
    p.add_argument(
        "--mtu",
        type=int,
        default=9000,
        help="MTU of the links (default %(default)s, jumbo frames as in "
        "training clusters; 1500 adds 4.4%% of headers to every link, "
        "which t_opt does not count)",
    )
    p.add_argument(
        "--no-ring", action="store_true", help="skip the gloo ring all-reduce"
    )
    p.add_argument(
        "--no-plain", action="store_true", help="skip the plain PS runs"
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="also run mixed mode with TLS everywhere, against plaintext",
    )
    p.add_argument(
        "--tuned",
        action="store_true",
        help="also run mixed mode with a hand-tuned partition of 2 ms of "
        "link time, against the main row",
    )
    p.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the children's logs (kept anyway on failure)",
    )
    p.add_argument(
        "--cleanup",
        action="store_true",
        help="delete leftover jxb- namespaces and exit",
    )
    # The roles of the child processes.
    hidden = argparse.SUPPRESS
    p.add_argument("--child", choices=sorted(CHILDREN), help=hidden)
    p.add_argument("--rank", type=int, help=hidden)
    p.add_argument("--num-workers", type=int, help=hidden)
    p.add_argument("--coordinator", help=hidden)
    p.add_argument("--my-ip", help=hidden)
    p.add_argument("--port", type=int, help=hidden)
    p.add_argument("--connect", help=hidden)
    p.add_argument("--bytes", type=int, help=hidden)
    p.add_argument("--elements", type=int, help=hidden)
    p.add_argument("--credit-bytes", type=int, default=0, help=hidden)
    args = p.parse_args(argv)
    if args.child:
        return args
    base = QUICK if args.quick else DEFAULTS
    for name, value in base.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.mb <= 0 or args.repeats < 1 or args.rate_mbit <= 0:
        p.error("--mb and --rate-mbit must be > 0 and --repeats >= 1")
    if args.partition_kib is not None and args.partition_kib < 1:
        p.error("--partition-kib must be >= 1")
    if args.server_processes < 1:
        p.error(f"--server-processes must be >= 1, got {args.server_processes}")
    if any("=" not in kv for kv in args.sysctl):
        p.error("--sysctl takes KEY=VALUE")
    args.elements = max(1, int(args.mb * 1e6) // 4)
    # 0: jaxps' own
    args.partition_bytes = (args.partition_kib or 0) * 1024
    args.credit_bytes = args.credit_kib * 1024
    return args


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return CHILDREN[args.child](args)
    if args.cleanup:
        removed = _netns.cleanup()
        print(f"removed {len(removed)} namespace(s): {' '.join(removed)}")
        return 0
    reason = _netns.unavailable()
    if reason:
        print(f"cluster.py: {reason}", file=sys.stderr)
        return 2
    configs = parse_configs(args.configs)
    cluster = _netns.Cluster(
        max(n for n, _ in configs),
        max(k for _, k in configs),
        args.rate_mbit,
        mtu=args.mtu,
        queue_ms=args.queue_ms,
        qdisc=args.qdisc,
        sysctls=dict(kv.split("=", 1) for kv in args.sysctl),
    )
    # Children and namespaces go away however this process ends: normally,
    # on an exception, on SIGTERM/SIGHUP (made SystemExit) or at exit.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    atexit.register(cluster.down)
    atexit.register(_netns.stop_all)  # runs first
    log_dir = tempfile.mkdtemp(prefix="jaxps-cluster-")
    ok = False
    cpu = CpuMeter()
    try:
        log(
            f"building {len(cluster.hosts)} hosts at {args.rate_mbit:g} "
            f"Mbit/s ({cluster.prefix}*), logs in {log_dir}"
        )
        cluster.up()
        log(f"link: {cluster.shaping()}")
        bench = Bench(cluster, args, log_dir)
        if args.tls:
            bench.tls = _certificate(cluster, log_dir)
        goodput = bench.goodput()
        log(f"one TCP stream: {goodput:.1f} Mbit/s")
        ring: dict[int, dict] = {}
        if not args.no_ring:
            for n in sorted({n for n, _ in configs}):
                log(f"ring all-reduce, n={n} ...")
                ring[n] = bench.ring(n)
                log(f"  {_times(ring[n])}")
        rows: dict[tuple[int, int], dict] = {}
        for n, k in configs:
            log(f"jaxps mixed mode, n={n} k={k} ...")
            rows[(n, k)] = {"mixed": bench.jaxps(n, k, colocated=True)}
            log(f"  {_times(rows[(n, k)]['mixed'])}")
            if k > 0 and not args.no_plain:
                log(f"jaxps plain PS, n={n} k={k} ...")
                rows[(n, k)]["plain"] = bench.jaxps(n, k, colocated=False)
                log(f"  {_times(rows[(n, k)]['plain'])}")
            if args.tls:
                log(f"jaxps mixed mode with TLS, n={n} k={k} ...")
                rows[(n, k)]["tls"] = bench.jaxps(n, k, True, tls=True)
                log(f"  {_times(rows[(n, k)]['tls'])}")
            if args.tuned:
                log(f"jaxps mixed mode, hand-tuned, n={n} k={k} ...")
                rows[(n, k)]["tuned"] = bench.jaxps(n, k, True, tuned=True)
                log(f"  {_times(rows[(n, k)]['tuned'])}")
        print_report(args, cluster, goodput, rows, ring, cpu)
        if args.tls:
            print("\nTLS everywhere (data channel on TLS) against plaintext, ")
            print("mixed mode, in the same run (median slowest worker):")
            for (n, k), row in rows.items():
                plain = statistics.median(row["mixed"]["times"])
                tls = statistics.median(row["tls"]["times"])
                print(
                    f"  ({n},{k}): plaintext {plain:.2f} s, TLS {tls:.2f} s, "
                    f"TLS/plaintext {tls / plain:.2f}"
                )
        if args.tuned:
            print("\nthe main row against a hand-tuned partition of 2 ms of")
            print("link time, mixed mode, in the same run (median slowest")
            print("worker):")
            for (n, k), row in rows.items():
                main = statistics.median(row["mixed"]["times"])
                tuned = statistics.median(row["tuned"]["times"])
                workers = row["mixed"]["workers"]
                if workers[0]["tuned"]:
                    log(f"  ({n},{k}) measured: {workers[0]['tuned']}")
                how = "set" if args.partition_bytes else "'auto' chose"
                print(
                    f"  ({n},{k}): main ({how} {chosen_partition(row['mixed'])}"
                    f" B) {main:.2f} s, tuned "
                    f"({tuned_partition(args.rate_mbit)} B) {tuned:.2f} s, "
                    f"main/tuned {main / tuned:.2f}"
                )
        log(f"total {time.monotonic() - cpu.wall:.0f} s")
        ok = True
    finally:
        _netns.stop_all()
        cluster.down()
        if ok and not args.keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            log(f"logs kept in {log_dir}")
    return 0


def _certificate(cluster, directory: str) -> tuple[str, str]:
    """A self-signed certificate for every host's address, and its key."""
    cert = os.path.join(directory, "cert.pem")
    key = os.path.join(directory, "key.pem")
    if not os.path.exists(cert):
        names = ",".join(f"IP:{h.ip}" for h in cluster.hosts)
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
             "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=jaxps",
             "-addext", f"subjectAltName={names}"],
            check=True,
            capture_output=True,
        )  # fmt: skip
    return cert, key


def _times(run: dict) -> str:
    return (
        "slowest worker per repetition: "
        + " ".join(f"{t:.2f}" for t in run["times"])
        + " s; first start to last end: "
        + " ".join(f"{t:.2f}" for t in run["spans"])
        + " s"
    )


if __name__ == "__main__":
    sys.exit(main())
