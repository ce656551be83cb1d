"""push_pull bandwidth of jaxps next to JAX, torch gloo and raw TCP.

Run from the repository root:

    python benchmarks/pushpull.py [--sizes-mb 4,64,256]

Two worker processes sum one float32 array per size with each backend, all
on 127.0.0.1 and in the same run:

* jaxps: 2 summation servers (``python -m jaxps.servers``) and 2 workers
  calling ``jaxps.push_pull_numpy``; every sum is checked.
* jax-gloo: ``jax.distributed`` with 2 processes of one CPU device each, and
  a jitted ``shard_map`` ``psum`` over the 2 global devices (gloo CPU
  collectives, the default of jax 0.10).
* torch-gloo: ``torch.distributed.all_reduce`` on the gloo backend; skipped
  when torch cannot be imported.
* tcp: one socket between 2 processes; one side sends the bytes, the other
  echoes them back while they arrive (the machine's loopback limit for a
  message that goes out and comes back).

GB/s is bytes per worker / seconds of one push_pull (10^9 bytes), the median
of ``--repeats`` timed calls after one warm-up, each call preceded by a
barrier; a call's time is the slowest rank's. ``--profile DIR`` attaches
py-spy to the jaxps workers and servers and prints their hottest functions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

import _common
import numpy as np
from _common import LOOPBACK, MB, Child, log

from jaxps._src.launch import process

BACKENDS = ("jaxps", "jax", "torch", "tcp")
COLUMNS = {
    "jaxps": "jaxps",
    "jax": "jax-gloo",
    "torch": "torch-gloo",
    "tcp": "tcp",
}
RESULT_PREFIX = "RESULT "
TORCH_SKIPPED = "skipped (pip install torch==2.13.0)"
NUM_WORKERS = 2
NUM_SERVERS = 2


# -- data shared by all workers -----------------------------------------------


def make_data(num_elements: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns rank's float32 contribution and the exact sum over all ranks.

    Values are small integers, so float32 sums are exact in any order.
    """
    base = np.resize(np.arange(1024, dtype=np.float32), num_elements)
    total = sum(r + 1 for r in range(NUM_WORKERS))
    return base * (rank + 1), base * total


def time_calls(sizes_mb, repeats, call, barrier, check=None) -> dict:
    """Times ``call(size_mb, rep)`` after a ``barrier()`` each.

    ``check(size_mb, rep, value)`` then verifies the call's return value,
    outside the timed region. The first call of each size (``rep == 0``) is
    a warm-up and is not reported. Returns ``{str(size_mb): [seconds]}``.
    """
    times = {}
    for size_mb in sizes_mb:
        runs = []
        for rep in range(repeats + 1):
            barrier()
            start = time.perf_counter()
            value = call(size_mb, rep)
            elapsed = time.perf_counter() - start
            if check is not None:
                check(size_mb, rep, value)
            if rep > 0:
                runs.append(elapsed)
        times[str(size_mb)] = runs
    return times


def report(result: dict) -> None:
    """Prints a worker's result line for the parent to read."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# -- workers -------------------------------------------------------------------


def jaxps_worker(args) -> dict:
    """Runs push_pull_numpy for each size; asserts every sum."""
    import jaxps

    settings = {}
    if args.partition_bytes:
        settings["partition_bytes"] = args.partition_bytes
    if args.credit_bytes:
        settings["credit_bytes"] = args.credit_bytes
    jaxps.init(**settings)
    tick = np.zeros(1, np.float32)
    state = {}

    def barrier():
        jaxps.push_pull_numpy("barrier", tick, average=False)

    def call(size_mb, rep):
        if rep == 0:
            state["x"], state["expected"] = make_data(
                size_mb * MB // 4, args.rank
            )
        return jaxps.push_pull_numpy(
            f"bench-{size_mb}mb", state["x"], average=False
        )

    def check(size_mb, rep, y):
        assert np.array_equal(y, state["expected"]), (
            f"jaxps sum of {size_mb} MiB is wrong on rank {args.rank} "
            f"(repetition {rep})"
        )

    try:
        times = time_calls(args.sizes_mb, args.repeats, call, barrier, check)
    finally:
        jaxps.shutdown()
    return {
        "times": times,
        "version": f"{jaxps.__version__} from "
        f"{os.path.dirname(jaxps.__file__)}",
    }


def jax_worker(args) -> dict:
    """Runs a jitted shard_map psum over the 2 processes' CPU devices."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = f"{LOOPBACK}:{args.port}"
    jax.distributed.initialize(
        coordinator_address=address,
        coordinator_bind_address=address,
        num_processes=NUM_WORKERS,
        process_id=args.rank,
    )
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    assert len(devices) == NUM_WORKERS, devices
    mesh = Mesh(np.array(devices), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    psum = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(v, "x"),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
        )
    )
    (local_device,) = jax.local_devices()
    state = {}

    def barrier():
        multihost_utils.sync_global_devices("bench")

    def call(size_mb, rep):
        if rep == 0:
            n = size_mb * MB // 4
            x, expected = make_data(n, args.rank)
            shard = jax.device_put(x, local_device)
            state["x"] = jax.make_array_from_single_device_arrays(
                (NUM_WORKERS * n,), sharding, [shard]
            )
            state["expected"] = expected
        return psum(state["x"]).block_until_ready()

    def check(size_mb, rep, y):
        if rep == 0:
            got = np.asarray(y.addressable_shards[0].data)
            assert np.array_equal(got, state["expected"]), "jax psum wrong"

    times = time_calls(args.sizes_mb, args.repeats, call, barrier, check)
    jax.distributed.shutdown()
    return {"times": times, "version": jax.__version__}


def torch_worker(args) -> dict:
    """Runs torch.distributed.all_reduce (gloo) for each size."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as err:
        return {"skipped": str(err)}
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{LOOPBACK}:{args.port}",
        rank=args.rank,
        world_size=NUM_WORKERS,
    )
    state = {}

    def barrier():
        state["t"].copy_(state["src"])  # all_reduce works in place
        dist.barrier()

    def call(size_mb, rep):
        dist.all_reduce(state["t"])

    def check(size_mb, rep, _):
        if rep == 0:
            assert torch.equal(state["t"], state["expected"]), "torch wrong"

    times = {}
    for size_mb in args.sizes_mb:
        x, expected = make_data(size_mb * MB // 4, args.rank)
        state.update(
            src=torch.from_numpy(x),
            t=torch.empty_like(torch.from_numpy(x)),
            expected=torch.from_numpy(expected),
        )
        times.update(time_calls([size_mb], args.repeats, call, barrier, check))
    dist.destroy_process_group()
    return {"times": times, "version": torch.__version__}


def tcp_worker(args) -> dict:
    """Rank 0 sends each message and reads it back; rank 1 echoes it."""
    sock = _tcp_connect(args.rank, args.port)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    echo = bytearray(4 * MB)
    state = {}

    def barrier():
        if args.rank == 0:
            sock.sendall(b"b")
            _recv_exact(sock, memoryview(bytearray(1)))
        else:
            _recv_exact(sock, memoryview(bytearray(1)))
            sock.sendall(b"b")

    def call(size_mb, rep):
        nbytes = size_mb * MB
        if args.rank == 1:
            _echo(sock, nbytes, memoryview(echo))
            return
        if rep == 0:
            state["out"] = np.random.default_rng(0).bytes(nbytes)
            state["back"] = bytearray(nbytes)
        sender = threading.Thread(target=sock.sendall, args=(state["out"],))
        sender.start()
        _recv_exact(sock, memoryview(state["back"]))
        sender.join()

    def check(size_mb, rep, _):
        if rep == 0 and args.rank == 0:
            assert state["back"] == state["out"], "tcp echo corrupted data"

    times = time_calls(args.sizes_mb, args.repeats, call, barrier, check)
    sock.close()
    # Only the side that sends and receives back times a whole message.
    return {"times": times if args.rank == 0 else {}}


def _tcp_connect(rank: int, port: int) -> socket.socket:
    """Rank 1 accepts one connection on `port`; rank 0 connects to it."""
    if rank == 1:
        with socket.create_server((LOOPBACK, port)) as server:
            server.settimeout(60)
            conn, _ = server.accept()
            conn.settimeout(None)
            return conn
    deadline = time.monotonic() + 60
    while True:
        try:
            return socket.create_connection((LOOPBACK, port), timeout=60)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` from `sock`."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


def _echo(sock: socket.socket, nbytes: int, buf: memoryview) -> None:
    """Sends back each piece of `nbytes` incoming bytes as it arrives."""
    remaining = nbytes
    while remaining:
        n = sock.recv_into(buf[: min(remaining, len(buf))])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        sock.sendall(buf[:n])
        remaining -= n


WORKERS = {
    "jaxps": jaxps_worker,
    "jax": jax_worker,
    "torch": torch_worker,
    "tcp": tcp_worker,
}


# -- the parent ------------------------------------------------------------


def worker_argv(args, role: str, rank: int, port: int) -> list[str]:
    """The command line that runs one worker of `role`."""
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--role",
        role,
        "--rank",
        str(rank),
        "--port",
        str(port),
        "--sizes-mb",
        ",".join(map(str, args.sizes_mb)),
        "--repeats",
        str(args.repeats),
    ]
    if args.partition_bytes:
        argv += ["--partition-bytes", str(args.partition_bytes)]
    if args.credit_bytes:
        argv += ["--credit-bytes", str(args.credit_bytes)]
    return argv


def collect(workers: list[Child]) -> list[dict]:
    """Reads the result line of every finished worker."""
    results = []
    for child in workers:
        lines = [
            ln
            for ln in child.stdout().splitlines()
            if ln.startswith(RESULT_PREFIX)
        ]
        if not lines:
            raise RuntimeError(
                f"{child.name} printed no result:\n{child.stderr_tail()}"
            )
        results.append(json.loads(lines[-1][len(RESULT_PREFIX) :]))
    return results


def run_backend(args, backend: str, log_dir: str) -> dict:
    """Runs the 2 workers (and for jaxps the servers) of one backend.

    Returns ``{"gbps": {size: GB/s}}`` or ``{"skipped": reason}``.
    """
    env = {"JAX_PLATFORMS": "cpu", "GLOO_SOCKET_IFNAME": "lo"}
    with _common.children() as started:
        if backend == "jaxps":
            servers = start_servers(args, log_dir, started)
            env.update(
                JAXPS_SERVERS=",".join(servers),
                JAXPS_NUM_WORKERS=str(NUM_WORKERS),
            )
        port = _common.free_port()
        workers = []
        for rank in range(NUM_WORKERS):
            env_r = dict(env, JAXPS_WORKER_RANK=str(rank))
            child = Child(
                f"{backend}-worker{rank}",
                worker_argv(args, backend, rank, port),
                log_dir,
                env_r,
            )
            started.append(child)
            workers.append(child)
        spies = []
        if args.profile and backend == "jaxps":
            spies = [
                attach_py_spy(c, args.profile, log_dir, args.native)
                for c in started
            ]
            started.extend(spies)  # stopped on failure too
        process.wait_all(workers, time.monotonic() + args.timeout)
        results = collect(workers)
        if spies:
            stop_profiled(started, spies)
    skipped = [r["skipped"] for r in results if "skipped" in r]
    if skipped:
        return {"skipped": skipped[0]}
    gbps = {}
    for size_mb in args.sizes_mb:
        per_rank = [r["times"][str(size_mb)] for r in results if r["times"]]
        slowest = [max(reps) for reps in zip(*per_rank)]
        gbps[size_mb] = size_mb * MB / _common.median(slowest) / 1e9
    return {"gbps": gbps, "version": results[0].get("version")}


def start_servers(args, log_dir: str, started: list[Child]) -> list[str]:
    """Starts the jaxps servers; returns their addresses once listening."""
    servers = []
    for i in range(NUM_SERVERS):
        argv = process.server_argv(NUM_WORKERS, port=0)
        if args.engine_threads:
            argv += ["--engine-threads", str(args.engine_threads)]
        child = Child(f"jaxps-server{i}", argv, log_dir)
        started.append(child)
        servers.append(child)
    deadline = time.monotonic() + 60
    addresses = [process.server_address(s, deadline) for s in servers]
    for address in addresses:
        assert address.startswith(LOOPBACK + ":"), address
    return addresses


def attach_py_spy(
    target: Child, out_dir: str, log_dir: str, native: bool
) -> Child:
    """Starts py-spy recording `target` into ``out_dir/<name>.txt``.

    Without `native` py-spy samples without pausing the target; with it,
    it pauses the target for each sample to read its C stacks too.
    """
    py_spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    out = os.path.join(out_dir, f"{target.name}.txt")
    mode = ["--native"] if native else ["--nonblocking"]
    return Child(
        f"py-spy-{target.name}",
        [
            py_spy,
            "record",
            "--pid",
            str(target.proc.pid),
            "--format",
            "raw",
            "--rate",
            "100",
            *mode,
            "--output",
            out,
        ],
        log_dir,
    )


def stop_profiled(started: list[Child], spies: list[Child]) -> None:
    """Stops the servers so their py-spy writes its file, then waits."""
    for child in started:
        if child.name.startswith("jaxps-server"):
            child.stop()
    for spy in spies:
        try:
            spy.wait(time.monotonic() + 30)
        except TimeoutError:
            log(f"{spy.name} did not finish; its profile may be missing")
        spy.stop()


#: Stack frames of the benchmark's own work, left out of the profiles.
SETUP_FRAMES = ("make_data (pushpull", "check (pushpull", "<frozen importlib")


def print_profiles(out_dir: str, count: int = 10) -> None:
    """Prints the hottest functions of each py-spy file in `out_dir`.

    Samples of the benchmark's setup (making and checking the arrays,
    imports) are left out.
    """
    for name in sorted(os.listdir(out_dir)):
        if not name.endswith(".txt"):
            continue
        print(
            f"\npy-spy hottest functions (self time) of "
            f"{name.removesuffix('.txt')}:"
        )
        path = os.path.join(out_dir, name)
        for frame, share in _common.top_frames(path, count, SETUP_FRAMES):
            print(f"  {share:6.1%}  {frame}")


def fmt(value: float | None) -> str:
    """Formats a GB/s figure."""
    return "n/a" if value is None else f"{value:.3f}"


def print_results(args, results: dict[str, dict]) -> None:
    """Prints the bandwidth table and the jaxps ratios."""
    header = (
        ["size (MiB)"]
        + [f"{COLUMNS[b]} GB/s" for b in BACKENDS]
        + ["jaxps/jax-gloo", "jaxps/tcp"]
    )
    rows = []
    for size_mb in args.sizes_mb:
        row, gbps = [str(size_mb)], {}
        for backend in BACKENDS:
            res = results.get(backend)
            if res is None:
                row.append("not run")
            elif "skipped" in res:
                row.append(TORCH_SKIPPED if backend == "torch" else "skipped")
            else:
                gbps[backend] = res["gbps"][size_mb]
                row.append(fmt(gbps[backend]))
        for other in ("jax", "tcp"):
            if "jaxps" in gbps and other in gbps:
                row.append(f"{gbps['jaxps'] / gbps[other]:.2f}x")
            else:
                row.append("n/a")
        rows.append(row)
    print(_common.format_table(header, rows))
    for backend in BACKENDS:
        version = (results.get(backend) or {}).get("version")
        if version:
            print(f"{COLUMNS[backend]}: {version}")
    other = [
        f"{COLUMNS[b]} {results[b]['other_cores']:.2f}"
        for b in BACKENDS
        if b in results
    ]
    print(
        "cores used by other processes meanwhile (0 = undisturbed): "
        + ", ".join(other)
    )
    torch_res = results.get("torch") or {}
    if "skipped" in torch_res:
        log(f"torch-gloo: {TORCH_SKIPPED}: {torch_res['skipped']}")


def parse_args(argv=None):
    """Parses and checks the command line (the parent's or a worker's)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sizes-mb",
        default="4,64,256",
        type=lambda s: [int(x) for x in s.split(",") if x],
        help="MiB of float32 per worker (default %(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=10,
        help="timed calls per size after 1 warm-up (default %(default)s)",
    )
    p.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help="comma-separated subset of %(default)s",
    )
    p.add_argument(
        "--engine-threads",
        type=int,
        default=0,
        help="jaxps server summation threads (default: the server's)",
    )
    p.add_argument(
        "--partition-bytes",
        type=int,
        default=0,
        help="jaxps chunk size (default: jaxps's)",
    )
    p.add_argument(
        "--credit-bytes",
        type=int,
        default=0,
        help="jaxps bytes in flight per server (default: jaxps's)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=0,
        help="seconds a backend may take (default: from sizes)",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="record the jaxps workers and servers with py-spy "
        "into DIR and print their hottest functions",
    )
    p.add_argument(
        "--native",
        action="store_true",
        help="with --profile: sample C/C++ frames too (slower)",
    )
    p.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the children's logs and print where",
    )
    # Internal: how the parent starts one worker.
    p.add_argument("--role", choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}; known: {BACKENDS}")
    if not args.sizes_mb or min(args.sizes_mb) < 1 or args.repeats < 1:
        p.error("--sizes-mb needs sizes >= 1 and --repeats must be >= 1")
    if not args.timeout:
        total_mb = sum(args.sizes_mb) * (args.repeats + 1)
        args.timeout = 120 + 0.2 * total_mb
    return args


def main(argv=None) -> int:
    """Runs every backend in turn and prints the table."""
    args = parse_args(argv)
    if args.role:
        report(WORKERS[args.role](args))
        return 0
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    log_dir = tempfile.mkdtemp(prefix="jaxps-bench-")
    log(
        f"load average before: {_common.load_average()} (over ~0.5: "
        "something else is running and the figures will be low)"
    )
    results = {}
    start = time.monotonic()
    try:
        for backend in args.backends:
            log(f"running {COLUMNS[backend]} ...")
            t0 = time.monotonic()
            other = _common.OtherLoad()
            results[backend] = run_backend(args, backend, log_dir)
            results[backend]["other_cores"] = other.cores()
            log(f"  {COLUMNS[backend]} done in {time.monotonic() - t0:.1f} s")
    except BaseException:
        log(f"the children's logs are in {log_dir}")
        raise
    log(f"all backends done in {time.monotonic() - start:.1f} s")
    print_results(args, results)
    if args.profile:
        print_profiles(args.profile)
    if args.keep_logs:
        log(f"logs in {log_dir}")
    else:
        shutil.rmtree(log_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
