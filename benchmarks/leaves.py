"""The cost of many leaves: a jitted push_pull of a tree of L leaves against
one leaf of the same bytes, in the same run.

Real models are not single tensors (ResNet-50: 161 parameter tensors,
BERT-base: about 200). Two workers and two servers on 127.0.0.1, one
device each; each worker times ``jax.jit(jaxps.push_pull)`` of a dict of
L equal float32 leaves for every L of ``--leaves`` and every size of
``--sizes-kib`` (bytes per call, split over the leaves). The peer of each
row is the 1-leaf call of the same bytes. Any jitted step with L inputs
and outputs pays JAX's dispatch of them, with or without jaxps: the "jit
alone" column times ``jax.jit`` of ``x * 1.5`` over the same tree, and
"net" compares the calls without it, ``(t_L - jit_L) / (t_1 - jit_1)``.
"rank CPU" is the CPU time of a rank's process (all its threads) per call,
the mean of the two ranks: steadier than the times on a busy host;
"servers CPU" that of both servers together (their time in the rows'
"jit alone" calls is nil)::

    python benchmarks/leaves.py [--leaves 1,50,200] [--sizes-kib 256,16384]

With ``--host`` each worker times the worker runtime alone, on NumPy
arrays without JAX (``push_pull_async`` and the wait for its sums): the
part of a call that is jaxps's own, where JAX's dispatch of L arrays
does not hide it ("jit alone" is then the time of ``x * 1.5`` in NumPy).

benchmarks/trees.py does the same for the trees of ResNet-50 and
BERT-base, against JAX's gloo all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--leaves", default="1,50,200")
    p.add_argument("--sizes-kib", default="256,16384", help="KiB per call")
    p.add_argument("--repeats", type=int, default=40, help="timed calls")
    p.add_argument(
        "--host", action="store_true", help="the runtime alone, without JAX"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> None:
    import jax
    import jax.numpy as jnp

    import jaxps

    jaxps.init()
    result = {}
    for kib in (int(s) for s in args.sizes_kib.split(",")):
        for leaves in (int(s) for s in args.leaves.split(",")):
            each = kib * 1024 // 4 // leaves
            tree = {
                f"w{i:03d}": jnp.full((each,), jaxps.rank() + 1.0)
                for i in range(leaves)
            }
            name = f"t{kib}x{leaves}"
            if args.host:
                f, alone = _host_calls(name, tree)
            else:
                f = jax.jit(lambda t, name=name: jaxps.push_pull(t, name=name))
                alone = jax.jit(lambda t: jax.tree.map(lambda v: v * 1.5, t))
            for _ in range(3):
                jax.block_until_ready(f(tree))
                jax.block_until_ready(alone(tree))
            times, floor, cpu = [], [], 0.0
            servers = _common.servers_cpu()
            for _ in range(args.repeats):  # in turns: the same conditions
                began, used = time.perf_counter(), time.process_time()
                out = jax.block_until_ready(f(tree))
                times.append(time.perf_counter() - began)
                cpu += time.process_time() - used
                began = time.perf_counter()
                jax.block_until_ready(alone(tree))
                floor.append(time.perf_counter() - began)
            servers = _common.servers_cpu() - servers
            assert float(out["w000"][0]) == 1.5, float(out["w000"][0])
            result[f"{kib},{leaves}"] = [
                _common.median(times),
                _common.median(floor),
                cpu / args.repeats,
                servers / args.repeats,
            ]
    print("RESULT " + json.dumps(result), flush=True)
    jaxps.shutdown()


def _host_calls(name: str, tree: dict):
    """(push_pull, x * 1.5) of `tree` in the worker runtime and in NumPy,
    on NumPy copies of its arrays."""
    import numpy as np

    from jaxps._src import state

    runtime = state.runtime()
    names = tuple(f"{name}['{k}']" for k in tree)
    arrays = [np.asarray(v) for v in tree.values()]

    def push_pull(_):
        sums = runtime.push_pull_async(
            names, arrays, call=name, donate=True
        ).wait()
        return dict(zip(tree, sums))

    def alone(_):
        return {k: v * 1.5 for k, v in zip(tree, arrays)}

    return push_pull, alone


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    argv = [sys.executable, os.path.abspath(__file__), "--child"]
    argv += ["--leaves", args.leaves, "--sizes-kib", args.sizes_kib]
    argv += ["--repeats", str(args.repeats)] + ["--host"] * args.host
    with tempfile.TemporaryDirectory(prefix="jaxps-leaves-") as tmp:
        results = _common.jaxps_job(argv, tmp, servers=2, env={"XLA_FLAGS": ""})

    def over_ranks(column: int, combine) -> dict[str, float]:
        return {
            key: combine([r[key][column] for r in results])
            for key in results[0]
        }

    # a call's time is the slower rank's
    times, floors = over_ranks(0, max), over_ranks(1, max)
    # CPU: all threads of a rank, the mean of both ranks (servers not
    # counted); the servers' together, as each rank saw them over its calls
    cpus = over_ranks(2, statistics.fmean)
    servers = over_ranks(3, statistics.fmean)
    rows = []
    for key, t in times.items():
        kib, leaves = key.split(",")
        one = times.get(f"{kib},1")
        net = None
        if one:
            net = (t - floors[key]) / (one - floors[f"{kib},1"])
        rows.append(
            [
                kib,
                leaves,
                f"{t * 1e3:.1f}",
                f"{t / one:.2f}" if one else "-",
                f"{floors[key] * 1e3:.2f}",
                f"{net:.2f}" if net else "-",
                f"{(t - one) / max(1, int(leaves) - 1) * 1e3:.3f}"
                if one and leaves != "1"
                else "-",
                f"{cpus[key] * 1e3:.1f}",
                f"{servers[key] * 1e3:.1f}",
            ]
        )
    header = [
        "KiB/call",
        "leaves",
        "ms/call",
        "x 1 leaf",
        "jit alone ms",
        "net x 1 leaf",
        "ms/extra leaf",
        "rank CPU ms/call",
        "servers CPU ms/call",
    ]
    print(_common.format_table(header, rows))
    print(
        f"(median of {args.repeats} calls, slower rank; load average "
        f"{_common.load_average()})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
