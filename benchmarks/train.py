"""Training-step scaling and communication overlap of jaxps on one machine.

Runs the synthetic flax models of ``examples/benchmark.py`` (forward,
backward, push_pull of all gradients through the summation servers, SGD
update) through ``jaxps-launch`` on loopback: 1 worker without servers, then
N workers with ``--servers`` servers. With ``--cluster`` (root) every worker
and server is a host of the emulated cluster of ``cluster.py`` instead (a
network namespace whose link is shaped to ``--rate-mbit``), so gradients
cross rate-limited links; the hosts still share this machine's cores.

    python benchmarks/train.py [--models resnet,transformer]
        [--workers 1,2,4] [--servers 2] [--batch-size 32] [--iters 5]
        [--cluster [--rate-mbit 100] [--mtu 9000]] [--partition-kib K]

Per model it prints a Markdown table:

- step ms: median over all workers' timed iterations of iteration time /
  steps; samples/sec per worker = batch / step; total = N x that;
- scaling eff = total(N) / (N x total(1));
- ideal smp/s/worker = total(1) x min(N, 2) / N, the compute-bound ceiling
  on 2 cores *if* one worker used one core (see cores/worker for how many it
  really uses), and vs ideal = samples/sec per worker / that;
- cores/worker: CPU seconds per wall second of a worker process during the
  timed steps; job cores: the same for launcher + servers + workers; other
  cores: everything else running on the machine meanwhile (a busy machine
  spoils the run);
- from the timeline traces (``JAXPS_TRACE_DIR``) of the timed steps only:
  comm = time a push_pull was in flight, exposed = time the step waited for
  it in the ``done`` callback, overlap = 1 - exposed / comm;

and a table of the chunk stages per step (start, queue, push, pull).

Every run is one ``jaxps-launch`` child with a timeout; the launcher stops
its servers and workers itself, and is sent SIGTERM (then SIGKILL) if it
overruns. A run in which other processes used more than
``--max-other-cores`` is repeated once (the less disturbed one is kept), and
a run that would likely end after ``--budget`` seconds is skipped.
The runs share a temporary JAX compilation cache (``--no-compile-cache`` to
turn it off), which shortens model set-up only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import time

from _common import format_table, load_average, log

from jaxps._src.process import Child, server_address, server_argv, wait_all

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
RESULT = "TRAIN_RESULT "
MODELS = ("resnet", "transformer")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        "--model",
        default=",".join(MODELS),
        help="comma-separated: resnet, transformer",
    )
    p.add_argument(
        "--workers",
        default="1,2,4",
        help="comma-separated worker counts (first should be 1)",
    )
    p.add_argument(
        "--servers",
        type=int,
        default=2,
        help="summation servers of the multi-worker runs",
    )
    p.add_argument(
        "--batch-size", type=int, default=32, help="batch size per worker"
    )
    p.add_argument(
        "--iters",
        type=int,
        default=5,
        help="timed iterations (each --batches-per-iter steps)",
    )
    p.add_argument("--batches-per-iter", type=int, default=3)
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps first (they include compilation)",
    )
    p.add_argument(
        "--run-timeout",
        type=float,
        default=150.0,
        help="seconds one launch may take",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=300.0,
        help="skip runs likely to end after this many seconds",
    )
    p.add_argument(
        "--jaxps-timeout",
        type=float,
        default=120.0,
        help="jaxps-launch --timeout (workers compile at "
        "different speeds on shared cores)",
    )
    p.add_argument(
        "--max-other-cores",
        type=float,
        default=0.25,
        help="repeat a run in which other processes used more cores than this",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=1,
        help="how often a disturbed run may be repeated",
    )
    p.add_argument(
        "--no-compile-cache",
        dest="compile_cache",
        action="store_false",
        help="do not share JAX's compilation cache between runs",
    )
    p.add_argument(
        "--partition-kib",
        type=int,
        default=0,
        help="JAXPS_PARTITION_BYTES in KiB (default: jaxps' own)",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="run every worker and server on its own host of an "
        "emulated cluster (network namespaces; needs root)",
    )
    p.add_argument(
        "--rate-mbit",
        type=float,
        default=100.0,
        help="--cluster: rate of every link, each way",
    )
    p.add_argument(
        "--mtu", type=int, default=9000, help="--cluster: MTU of the links"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-name", default="resnet", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    args.workers = [int(n) for n in args.workers.split(",") if n.strip()]
    if not args.workers or min(args.workers) < 1:
        p.error("--workers needs counts >= 1")
    if min(args.iters, args.batches_per_iter, args.warmup) < 1:
        p.error("--iters, --batches-per-iter and --warmup must be >= 1")
    if args.servers < 1 and max(args.workers) > 1:
        p.error("more than one worker needs --servers >= 1")
    return args


# ----------------------------------------------------------------------------
# Worker side: one rank of a jaxps-launch job.


def cpu_seconds(root: int) -> tuple[float, float]:
    """(busy CPU seconds of the machine, of `root` and its descendants).

    From /proc: the machine's non-idle time and the utime + stime of every
    process whose parent chain reaches `root` (the launcher: it and the
    servers and workers it started).
    """
    hz = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:9]]
    machine = sum(cpu) - cpu[3] - cpu[4]  # all but idle and iowait
    parent, ticks = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # already gone
        fields = stat[stat.rindex(")") + 2 :].split()
        parent[int(name)] = int(fields[1])
        ticks[int(name)] = int(fields[11]) + int(fields[12])
    ours = 0
    for pid, t in ticks.items():
        p = pid
        while p > 1 and p != root:
            p = parent.get(p, 0)
        ours += t if p == root else 0
    return machine / hz, ours / hz


def child(args: argparse.Namespace) -> None:
    """Runs examples/benchmark.py's main in this process, prints its rates.

    The example's `train_step` is wrapped (same function, called through)
    only to read the clocks when the first timed step starts. Rank 0 also
    measures how busy the machine was with other processes meanwhile.
    """
    sys.path.insert(0, EXAMPLES)
    import benchmark

    rank = int(os.environ.get("JAXPS_WORKER_RANK", "0"))
    step, clock = benchmark.train_step, {"calls": 0}

    def counted_step(*a, **k):
        if clock["calls"] == args.warmup:
            clock["cpu"], clock["wall"] = time.process_time(), time.time()
            clock["proc"] = cpu_seconds(os.getppid()) if rank == 0 else None
        clock["calls"] += 1
        return step(*a, **k)

    benchmark.train_step = counted_step
    rates = benchmark.main(
        [
            "--model",
            args.model_name,
            "--batch-size",
            str(args.batch_size),
            "--num-warmup-batches",
            str(args.warmup),
            "--num-batches-per-iter",
            str(args.batches_per_iter),
            "--num-iters",
            str(args.iters),
        ]
    )
    wall = time.time() - clock["wall"]
    result = {
        "rank": rank,
        "rates": rates,
        "cores": (time.process_time() - clock["cpu"]) / wall,
    }
    if clock["proc"] is not None:
        machine, ours = (
            b - a for a, b in zip(clock["proc"], cpu_seconds(os.getppid()))
        )
        result["job_cores"] = ours / wall
        result["other_cores"] = max(0.0, machine - ours) / wall
    print(RESULT + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------
# Driver side.


def timed_events(events: list[dict], steps: int) -> tuple[list[dict], int]:
    """The trace events of the last `steps` steps; and all push_pulls.

    Every step runs one push_pull of all gradients, i.e. one ``in_flight``,
    ``start`` and ``done`` span (before them come the broadcast and the
    warm-up steps); the chunk stages are kept from the first timed push_pull
    on.
    """

    def last(name, **match):
        spans = [
            e
            for e in events
            if e.get("name") == name
            and all(e.get(k) == v for k, v in match.items())
        ]
        return sorted(spans, key=lambda e: e["ts"])[-steps:]

    flights = last("in_flight")
    begin = flights[0]["ts"] if flights else float("inf")
    stages = [
        e
        for e in events
        if e.get("name") in ("queue", "push", "pull") and e["ts"] >= begin
    ]
    total = sum(1 for e in events if e.get("name") == "in_flight")
    return (
        flights
        + last("start", tid="device")
        + last("done", tid="device")
        + stages
    ), total


def cache_env(args) -> dict[str, str]:
    """JAX's persistent compilation cache in this invocation's temp dir.

    The workers of later runs then load the many small programs of model
    set-up instead of compiling them again (the train step, which has host
    callbacks, is compiled anyway); only set-up time changes.
    """
    if not args.cache_dir:
        return {}
    return {
        "JAX_COMPILATION_CACHE_DIR": args.cache_dir,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }


def run_launcher(args, label, workers, servers, child_argv, env, tmp) -> str:
    """Runs the workers (and servers) with jaxps-launch; returns stdout."""
    cmd = [
        sys.executable,
        "-m",
        "jaxps._src.launch",
        "--workers",
        str(workers),
        "--servers",
        str(servers),
        "--timeout",
        str(args.jaxps_timeout),
        "--",
        *child_argv,
    ]
    # On timeout (or if this script is stopped) the launcher gets SIGTERM,
    # which makes it stop all of its servers and workers, then SIGKILL.
    launcher = Child(
        "launcher", cmd, env={**os.environ, **env}, cwd=tmp, log_dir=tmp
    )
    try:
        code = launcher.wait(time.monotonic() + args.run_timeout)
    except TimeoutError:
        code = None
    finally:
        launcher.stop(grace=20)
    if code != 0:
        why = "timed out" if code is None else f"exited {code}"
        raise RuntimeError(
            f"{label}: launcher {why}:\n{launcher.stderr_tail(15)}"
        )
    return launcher.stdout()


def run_on_cluster(args, label, workers, servers, child_argv, env, tmp) -> str:
    """Runs each worker and server on its own emulated host; returns the
    workers' stdout."""
    import _netns

    cluster = args.emulated
    args.port += 1  # a fresh port: never one of a dying server
    base = _netns.child_env(dict(env, JAXPS_TIMEOUT=str(args.jaxps_timeout)))
    procs: list = []
    try:
        for host in cluster.servers[:servers]:
            argv = server_argv(
                workers,
                "--round-timeout",
                str(args.jaxps_timeout),
                host=host.ip,
                port=args.port,
            )
            procs.append(
                _netns.Proc(f"server-{host.role}", host.ns, argv, tmp, base)
            )
        deadline = time.monotonic() + 60
        for proc in procs:
            server_address(proc, deadline)
        addresses = ",".join(
            f"{h.ip}:{args.port}" for h in cluster.servers[:servers]
        )
        ranks = []
        for rank, host in enumerate(cluster.workers[:workers]):
            worker_env = dict(
                base,
                JAXPS_NUM_WORKERS=str(workers),
                JAXPS_WORKER_RANK=str(rank),
            )
            if servers:
                worker_env["JAXPS_SERVERS"] = addresses
            ranks.append(
                _netns.Proc(
                    f"worker-{host.role}", host.ns, child_argv, tmp, worker_env
                )
            )
        procs += ranks
        try:
            wait_all(ranks, time.monotonic() + args.run_timeout)
        except RuntimeError as err:
            raise RuntimeError(f"{label}: {err}") from None
        return "\n".join(proc.stdout() for proc in ranks)
    finally:
        for proc in procs:
            proc.stop()


def run(args, model: str, workers: int) -> dict:
    from jaxps._src import timeline

    servers = 0 if workers == 1 else args.servers
    steps = args.iters * args.batches_per_iter
    with tempfile.TemporaryDirectory(prefix="jaxps-train-") as tmp:
        env = {"JAXPS_TRACE_DIR": tmp, **cache_env(args)}
        if args.partition_kib:
            env["JAXPS_PARTITION_BYTES"] = str(args.partition_kib * 1024)
        child_argv = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            "--model-name",
            model,
            "--batch-size",
            str(args.batch_size),
            "--iters",
            str(args.iters),
            "--batches-per-iter",
            str(args.batches_per_iter),
            "--warmup",
            str(args.warmup),
        ]
        began = time.monotonic()
        start = run_on_cluster if args.cluster else run_launcher
        out = start(
            args, f"{model} x{workers}", workers, servers, child_argv, env, tmp
        )
        took = time.monotonic() - began
        results = [
            json.loads(line.split(RESULT, 1)[1])
            for line in out.splitlines()
            if RESULT in line
        ]
        if len(results) != workers:
            raise RuntimeError(f"{model} x{workers}: {len(results)} results")
        params = re.search(r"Model: \w+ \(([\d,]+) parameters\)", out)
        step_s = [args.batch_size / r for res in results for r in res["rates"]]
        sums = dict.fromkeys(
            ("exposed_s", "comm_s", "start_s", "queue_s", "push_s", "pull_s"),
            0.0,
        )
        counts, chunks, rows, pulls = set(), 0, set(), []
        for rank in range(workers):
            path = os.path.join(tmp, f"jaxps-rank{rank}.trace.json")
            events, total = timed_events(timeline.load(path), steps)
            counts.add(total)
            for key, value in timeline.summarize(events).items():
                if key in sums:
                    sums[key] += value
            pushes = [e for e in events if e.get("name") == "push"]
            chunks += len(pushes)
            rows.update(e["tid"] for e in pushes)
            pulls.append(
                [
                    e["dur"] / 1e6
                    for e in sorted(
                        (e for e in events if e.get("name") == "pull"),
                        key=lambda e: e["ts"],
                    )
                ]
            )
    per_step = {k[:-2]: v / (workers * steps) for k, v in sums.items()}
    exposed, comm = sums["exposed_s"], sums["comm_s"]
    return {
        "model": model,
        "workers": workers,
        "servers": servers,
        "step_s": statistics.median(step_s),
        "step_min": min(step_s),
        "step_max": max(step_s),
        "cores": statistics.mean(r["cores"] for r in results),
        "job_cores": results_of(results, 0)["job_cores"],
        "other_cores": results_of(results, 0)["other_cores"],
        **per_step,
        "chunks": chunks / (workers * steps),
        "servers_used": len(rows),
        # The worker whose push completes a round waits for nobody: the
        # shortest pull of each round is about the transfer alone.
        "pull_last": (
            statistics.mean(min(p) for p in zip(*pulls))
            if pulls and all(pulls)
            else 0.0
        ),
        "overlap": 1.0 - min(exposed, comm) / comm if comm else None,
        "push_pulls": sorted(counts),
        "params": params and params.group(1),
        "took": took,
    }


def results_of(results: list[dict], rank: int) -> dict:
    return next(r for r in results if r["rank"] == rank)


def table(args, rows: list[dict]) -> str:
    base = next((r for r in rows if r["workers"] == 1), None)
    total1 = args.batch_size / base["step_s"] if base else None
    header = [
        "workers",
        "servers",
        "step ms",
        "smp/s/worker",
        "total smp/s",
        "scaling eff",
        "ideal smp/s/worker",
        "vs ideal",
        "cores/worker",
        "job cores",
        "other cores",
        "comm ms/step",
        "exposed ms/step",
        "overlap",
    ]
    body = []
    for r in rows:
        n = r["workers"]
        per = args.batch_size / r["step_s"]
        ideal = total1 * min(n, 2) / n if total1 else None
        comm = r["comm"] > 0
        body.append(
            [
                str(n),
                str(r["servers"]),
                f"{1e3 * r['step_s']:.1f}",
                f"{per:.1f}",
                f"{n * per:.1f}",
                f"{n * per / (n * total1):.2f}" if total1 else "-",
                f"{ideal:.1f}" if ideal else "-",
                f"{per / ideal:.2f}" if ideal else "-",
                f"{r['cores']:.2f}",
                f"{r['job_cores']:.2f}",
                f"{r['other_cores']:.2f}",
                f"{1e3 * r['comm']:.1f}" if comm else "-",
                f"{1e3 * r['exposed']:.1f}" if comm else "-",
                f"{r['overlap']:.2f}" if r["overlap"] is not None else "-",
            ]
        )
    return format_table(header, body)


def detail(rows: list[dict]) -> str:
    """Where the communication time of a step went, per worker."""
    header = [
        "workers",
        "chunks/step",
        "servers used",
        "start ms",
        "queue ms",
        "push ms",
        "pull ms",
        "pull of last rank ms",
        "in flight ms",
        "exposed ms",
    ]
    body = [
        [
            str(r["workers"]),
            f"{r['chunks']:.1f}",
            str(r["servers_used"]),
            *(
                f"{1e3 * r[k]:.1f}"
                for k in (
                    "start",
                    "queue",
                    "push",
                    "pull",
                    "pull_last",
                    "comm",
                    "exposed",
                )
            ),
        ]
        for r in rows
        if r["servers"]
    ]
    return format_table(header, body) if body else ""


def versions() -> str:
    import flax
    import grpc
    import jax
    import numpy
    import optax

    import jaxps

    return (
        f"Python {platform.python_version()}, jax {jax.__version__}, "
        f"flax {flax.__version__}, optax {optax.__version__}, "
        f"grpcio {grpc.__version__}, numpy {numpy.__version__}, "
        f"jaxps {jaxps.__version__}; {os.cpu_count()} CPU cores"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    # A SIGTERM becomes SystemExit, so that `run_launcher` stops the launcher.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.ExitStack() as stack:
        args.cache_dir = None
        if args.compile_cache:
            args.cache_dir = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="jaxps-train-cache-")
            )
        if args.cluster:
            import _netns

            why = _netns.unavailable()
            if why:
                log(f"--cluster: {why}")
                return 2
            args.emulated = _netns.Cluster(
                max(args.workers), args.servers, args.rate_mbit, mtu=args.mtu
            )
            args.port = 9100
            stack.callback(args.emulated.down)
            stack.callback(_netns.stop_all)  # runs first
            args.emulated.up()
        return drive(args)


def measure(
    args, model: str, n: int, began: float, guess: float
) -> dict | None:
    """One run, repeated (`--retries`) while other processes disturbed it
    (`--max-other-cores`) and the budget allows; the least disturbed wins."""
    best = None
    for attempt in range(1 + args.retries):
        if attempt and time.monotonic() - began + guess > args.budget:
            break
        log(f"{model}: {n} worker(s), load {load_average()} ...")
        try:
            r = run(args, model, n)
        except (RuntimeError, OSError, ValueError, KeyError) as err:
            log(f"FAILED: {err}")
            return None
        guess = r["took"]
        if best is None or r["other_cores"] < best["other_cores"]:
            best = r
        if r["other_cores"] <= args.max_other_cores:
            break
        log(f"  other processes used {r['other_cores']:.2f} cores meanwhile")
    return best


def drive(args) -> int:
    began = time.monotonic()
    steps = args.iters * args.batches_per_iter
    print(f"# {versions()}")
    print(
        f"# batch {args.batch_size}/worker, {args.warmup} warm-up steps, "
        f"{args.iters} x {args.batches_per_iter} timed steps per worker; "
        + (
            f"emulated cluster, {args.rate_mbit:g} Mbit/s links, MTU {args.mtu}"
            if args.cluster
            else "loopback"
        )
        + (
            f"; partition {args.partition_kib} KiB"
            if args.partition_kib
            else ""
        ),
        flush=True,
    )
    failed = False
    last = None
    for model in args.models:
        rows = []
        for n in args.workers:
            # Set-up and compilation dominate a run and grow about linearly
            # with the workers sharing the cores: guess from the last run.
            guess = last["took"] * n / last["workers"] if last else 0.0
            if time.monotonic() - began + guess > args.budget:
                log(
                    f"{model} x{n}: skipped (would end past --budget "
                    f"{args.budget:g} s)"
                )
                continue
            r = measure(args, model, n, began, guess)
            if r is None:
                failed = True
                continue
            rows.append(r)
            last = r
            note = (
                f"; push_pulls per trace {r['push_pulls']} "
                f"(expected {1 + args.warmup + steps})"
                if r["servers"]
                else ""
            )
            log(
                f"  {r['took']:.0f} s; step {1e3 * r['step_s']:.1f} ms "
                f"(range {1e3 * r['step_min']:.1f}-{1e3 * r['step_max']:.1f})"
                + note
            )
        if not rows:
            continue
        params = rows[0]["params"] or "?"
        print(f"\n## {model} ({params} parameters)\n")
        print(table(args, rows), flush=True)
        more = detail(rows)
        if more:
            print(f"\nper step and worker, timed steps ({model}):\n")
            print(more, flush=True)
    print(f"\n# total {time.monotonic() - began:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
