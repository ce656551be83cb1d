"""The link rate changes while a job runs: ``partition_bytes="auto"`` that
measures again (the default) against one that measured once at init, and
against a partition hand-tuned for the new rate, in the same run.

Run as root from the repository root:

    python benchmarks/retune.py [--changes "400,100;100,400"]
        [--n 4] [--k 2] [--mb 4] [--before 24] [--after 48]
        [--retune-calls 16] [--steady 16]

For each ``A,B`` of ``--changes`` the emulated cluster of
``benchmarks/cluster.py`` (mixed mode: k CPU server hosts, a colocated
server on each of the n worker hosts) starts with links of A Mbit/s. The
workers make ``--before`` timed push_pulls of M bytes (``--mb``, 10^6
bytes; each after a 4-byte barrier, as in cluster.py), then every link is
shaped to B Mbit/s (tbf replaced in place, the connections kept) and the
workers make ``--after`` more. Three jobs run in turn:

* **retune**: jaxps' defaults with ``JAXPS_RETUNE_CALLS=--retune-calls``:
  the ranks see the rate move and measure again;
* **once**: ``JAXPS_RETUNE_CALLS=0``, the partition chosen at A stays;
* **tuned**: ``JAXPS_PARTITION_BYTES`` of 2 ms at B (cluster.py's
  ``--tuned``), the peer the defaults are judged against.

The table gives, after the change, the median of the last ``--steady``
calls (the slowest worker's) and the time of all the calls after it (the
slowest worker's, barriers included: the calls until the ranks measured
again, and the measurement, count), each also over the tuned job's.
With epochs of R calls the ranks first compare at the first epoch that
starts R/2 calls or more after the change, and measure when the next one
starts: with R=16 and the change after call 24, the
window of calls 24-39 is compared at call 40 and measured at call 48.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

import _netns
from _netns import Proc, child_env
from cluster import _exit_on_signal, log, report, results, tuned_partition

from jaxps._src.launch.process import server_addresses, server_argv, wait_all

BASE_PORT = 9400
TIMEOUT = 120  # JAXPS_TIMEOUT and --round-timeout
SERVER_START_TIMEOUT = 90.0
VARIANTS = ("retune", "once", "tuned")


def child_worker(args) -> int:
    """A worker: `before` timed calls, wait for the change, `after` more."""
    import numpy as np

    import jaxps
    from jaxps._src import state

    jaxps.init()
    n, rank = jaxps.size(), jaxps.rank()
    x = np.ones(args.elements, np.float32) * (rank + 1)
    tick = np.ones(1, np.float32)
    expected = n * (n + 1) // 2
    times = []
    runtime = state.runtime()

    def call():
        got = jaxps.push_pull_numpy("barrier", tick, average=False)
        assert got[0] == n, got
        start = time.monotonic()
        y = jaxps.push_pull_numpy("x", x, average=False)
        times.append(time.monotonic() - start)
        assert np.all(y == expected), f"rank {rank}: wrong sums"

    try:
        for _ in range(args.before):
            call()
        before = runtime.partition_bytes
        ready = os.path.join(args.sync_dir, f"ready-{rank}")
        open(ready, "w").close()
        go = os.path.join(args.sync_dir, "go")
        deadline = time.monotonic() + TIMEOUT
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: no {go} in {TIMEOUT} s")
            time.sleep(0.01)
        began = time.monotonic()
        for _ in range(args.after):
            call()
        phase = time.monotonic() - began
        retuner = runtime._retune
        result = {
            "rank": rank,
            "times": times,
            "phase": phase,
            "before": before,
            "after": runtime.partition_bytes,
            "measured": retuner.measured if retuner else 0,
            # the last measurement's seconds, on this rank
            "seconds": runtime.tuned.seconds
            if retuner and retuner.measured
            else 0.0,
        }
    finally:
        jaxps.shutdown()
    report(result)
    return 0


class Bench:
    def __init__(self, cluster: _netns.Cluster, args, log_dir: str):
        self.cluster, self.args, self.log_dir = cluster, args, log_dir
        self.port = BASE_PORT

    def run(self, variant: str, a: float, b: float) -> dict:
        """One job of `variant`: links at `a` Mbit/s, then at `b`."""
        args, cluster = self.args, self.cluster
        cluster.set_rate(a)
        label = f"{variant}-{a:g}-{b:g}"
        sync = os.path.join(self.log_dir, label)
        os.makedirs(sync)
        self.port += 1
        port = self.port
        placed = [(h, f"{label}-server-{h.role}") for h in cluster.servers]
        placed += [(h, f"{label}-coloc-{h.role}") for h in cluster.workers]
        servers, workers = [], []
        extra = {"JAXPS_RETUNE_CALLS": str(args.retune_calls)}
        if variant == "once":
            extra = {"JAXPS_RETUNE_CALLS": "0"}
        elif variant == "tuned":
            extra = {"JAXPS_PARTITION_BYTES": str(tuned_partition(b))}
        try:
            for host, name in placed:
                argv = server_argv(
                    args.n,
                    "--round-timeout",
                    str(TIMEOUT),
                    host=host.ip,
                    port=port,
                )
                servers.append(
                    Proc(name, host.ns, argv, self.log_dir, child_env())
                )
            deadline = time.monotonic() + SERVER_START_TIMEOUT
            for proc in servers:
                server_addresses(proc, 1, deadline)
            cpu = [f"{h.ip}:{port}" for h in cluster.servers]
            coloc = [f"{h.ip}:{port}" for h in cluster.workers]
            for rank, host in enumerate(cluster.workers):
                env = child_env(
                    {
                        "JAXPS_SERVERS": ",".join(cpu),
                        "JAXPS_COLOCATED_SERVERS": ",".join(coloc),
                        "JAXPS_NUM_WORKERS": str(args.n),
                        "JAXPS_WORKER_RANK": str(rank),
                        "JAXPS_TIMEOUT": str(TIMEOUT),
                        "JAXPS_JOB_ID": label,
                        **extra,
                    }
                )
                argv = [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--child",
                    "--elements",
                    str(args.elements),
                    "--before",
                    str(args.before),
                    "--after",
                    str(args.after),
                    "--sync-dir",
                    sync,
                ]
                workers.append(
                    Proc(
                        f"{label}-worker-{host.role}",
                        host.ns,
                        argv,
                        self.log_dir,
                        env,
                    )
                )
            self._change_when_ready(workers, sync, b)
            wait_all(workers, time.monotonic() + 30 * TIMEOUT)
        finally:
            for proc in workers + servers:
                proc.stop()
        per_worker = results(workers)
        calls = len(per_worker[0]["times"])
        worst = [max(w["times"][i] for w in per_worker) for i in range(calls)]
        after = worst[args.before :]
        return {
            "after": after,
            "steady": statistics.median(after[-args.steady :]),
            "total": max(w["phase"] for w in per_worker),
            "partitions": (per_worker[0]["before"], per_worker[0]["after"]),
            "measured": per_worker[0]["measured"],
            "seconds": max(w["seconds"] for w in per_worker),
        }

    def _change_when_ready(self, workers, sync: str, b: float) -> None:
        """Once every worker made its calls before the change: shapes the
        links to `b` and lets them go on."""
        deadline = time.monotonic() + 10 * TIMEOUT
        while len([f for f in os.listdir(sync) if f.startswith("ready")]) < (
            len(workers)
        ):
            for proc in workers:
                if proc.returncode not in (None, 0):
                    raise RuntimeError(
                        f"{proc.name} exited: {proc.stderr_tail()}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError("the workers did not finish their calls")
            time.sleep(0.02)
        self.cluster.set_rate(b)
        open(os.path.join(sync, "go"), "w").close()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--changes", default="400,100;100,400")
    p.add_argument("--n", type=int, default=4, help="worker hosts")
    p.add_argument("--k", type=int, default=2, help="CPU server hosts")
    p.add_argument("--mb", type=float, default=4.0, help="10^6 bytes a call")
    p.add_argument("--before", type=int, default=24)
    p.add_argument("--after", type=int, default=48)
    p.add_argument("--retune-calls", type=int, default=16)
    p.add_argument("--steady", type=int, default=16)
    p.add_argument("--keep-logs", action="store_true")
    hidden = argparse.SUPPRESS
    p.add_argument("--child", action="store_true", help=hidden)
    p.add_argument("--elements", type=int, help=hidden)
    p.add_argument("--sync-dir", help=hidden)
    args = p.parse_args(argv)
    if args.elements is None:
        args.elements = int(args.mb * 1e6 / 4)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_worker(args)
    reason = _netns.unavailable()
    if reason:
        print(f"retune.py: {reason}", file=sys.stderr)
        return 2
    changes = [
        tuple(float(r) for r in pair.split(","))
        for pair in args.changes.split(";")
    ]
    cluster = _netns.Cluster(args.n, args.k, changes[0][0], mtu=9000)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    atexit.register(cluster.down)
    atexit.register(_netns.stop_all)
    log_dir = tempfile.mkdtemp(prefix="jaxps-retune-")
    ok = False
    began = time.monotonic()
    try:
        cluster.up()
        bench = Bench(cluster, args, log_dir)
        print(
            f"n={args.n} k={args.k}, {args.mb:g} MB a call, the links change "
            f"after call {args.before}; {args.after} calls after it, the "
            f"last {args.steady} steady; epochs of {args.retune_calls} calls"
        )
        print(
            "\n| link change | job | partition before -> after | measured "
            "again (s) | steady | steady / tuned | all calls after | / tuned |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for a, b in changes:
            rows = {}
            for variant in VARIANTS:
                log(f"{a:g} -> {b:g} Mbit/s: {variant} ...")
                rows[variant] = bench.run(variant, a, b)
                log(f"  {rows[variant]}")
            tuned = rows["tuned"]
            for variant, row in rows.items():
                before, after = row["partitions"]
                print(
                    f"| {a:g} -> {b:g} | {variant} | {before} -> {after} | "
                    f"{row['measured']} ({row['seconds']:.1f}) | "
                    f"{row['steady'] * 1e3:.0f} ms | "
                    f"{row['steady'] / tuned['steady']:.2f} | "
                    f"{row['total']:.2f} s | "
                    f"{row['total'] / tuned['total']:.2f} |",
                    flush=True,
                )
            saved = rows["once"]["steady"] - rows["retune"]["steady"]
            if rows["retune"]["measured"] and saved > 0:
                repay = rows["retune"]["seconds"] / saved
                print(
                    f"| {a:g} -> {b:g} | the measurement repaid after "
                    f"{repay:.0f} calls | | | | | | |",
                    flush=True,
                )
        log(f"total {time.monotonic() - began:.0f} s")
        ok = True
    finally:
        _netns.stop_all()
        cluster.down()
        if ok and not args.keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            log(f"logs kept in {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
