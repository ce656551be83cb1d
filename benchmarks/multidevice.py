"""Hosts of several devices: the cost of jaxps's multi-device step paths.

Two workers on 127.0.0.1, each with L forced CPU devices, one server; an MLP
of two WIDTH x WIDTH layers trained with SGD. Per (L, WIDTH) it times, in
the same run and on the same data:

- ``local``: the step with no jaxps at all (each worker alone on its
  devices): the floor, the work every path shares;
- ``sharded jit``: `jaxps.DistributedOptimizer` in a `jax.jit` over a mesh
  of the worker's devices (each device pushes 1/L of the host's sum);
- ``shard_map``: the same step written with `jax.shard_map` and
  ``axis_name`` (reduce-scatter, push, all-gather);
- ``jax gloo``: JAX's own data parallelism, the peer: the two workers
  joined by ``jax.distributed`` into one mesh of 2L devices, the same step
  in one `jax.jit`, XLA's all-reduce over gloo;

and prints each path's median step time and its ratios to ``local`` and to
``jax gloo``, with the bytes each device pushed per step. On this 2-core
machine the workers' 2L devices share 2 cores: the figures compare the
paths, not the hardware.

    python benchmarks/multidevice.py     # L in 2,4; WIDTH 1024,2048
    python benchmarks/multidevice.py --devices 4 --widths 1024 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402

MODES = ("local", "sharded jit", "shard_map")
PEER = "jax gloo"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="2,4", help="L values, comma list")
    p.add_argument("--widths", default="1024,2048", help="layer widths")
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--gloo", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--local", type=int, default=2, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _params(width, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    scale = 1 / np.sqrt(width)
    return {
        k: (rng.standard_normal((width, width)) * scale).astype(np.float32)
        for k in ("w1", "w2")
    }


def _loss(p, x):
    import jax.numpy as jnp

    return jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)


def _timed(step, p, steps: int) -> float:
    """Median seconds of `steps` calls of ``p = step(p)`` after 2 more."""
    import jax

    for _ in range(2):  # compile, warm up
        p = step(p)
    jax.block_until_ready(p)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        p = step(p)
        jax.block_until_ready(p)
        times.append(time.perf_counter() - began)
    return _common.median(times)


def child_gloo(args) -> None:
    """The peer: 2 processes of L devices each in one jax.distributed mesh."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.local)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from cluster import _bind_gloo  # gloo on 127.0.0.1

    _bind_gloo(_common.LOOPBACK)
    jax.distributed.initialize(
        coordinator_address=args.gloo,
        coordinator_bind_address=args.gloo,
        num_processes=2,
        process_id=args.rank,
        initialization_timeout=120,
        shutdown_timeout_seconds=60,
    )
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    params = jax.device_put(_params(args.width, 0), NamedSharding(mesh, P()))
    rng = np.random.default_rng(args.rank)
    mine = rng.standard_normal((16 * args.local, args.width))
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), mine.astype(np.float32)
    )

    @jax.jit
    def step(p, x):  # XLA all-reduces the gradients over all 2L devices
        grads = jax.grad(_loss)(p, x)
        return jax.tree.map(lambda a, g: a - 0.01 * g, p, grads)

    seconds = _timed(lambda p: step(p, x), params, args.steps)
    result = {PEER: {"step_s": seconds, "bytes": 0}}
    print("RESULT " + json.dumps(result), flush=True)
    jax.distributed.shutdown()


def child(args) -> None:
    """One jaxps worker: the step without jaxps, then on both jaxps paths."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxps
    from jaxps.ops import _host

    jaxps.init()
    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), ("data",))
    auto = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(jaxps.rank())
    mine = rng.standard_normal((16 * devices, args.width)).astype(np.float32)
    params = _params(args.width, 0)

    def apply(p, grads):
        return jax.tree.map(lambda a, g: a - 0.01 * g, p, grads)

    dist = jaxps.DistributedOptimizer(optax.sgd(0.01), name="sharded")
    summed = jax.shard_map(
        lambda p, x: jaxps.push_pull(
            jax.grad(_loss)(p, x), axis_name="data", name="sm"
        ),
        mesh=auto,
        in_specs=(P(), P("data")),
        out_specs=P(),
    )

    @jax.jit
    def local(p, x):
        return apply(p, jax.grad(_loss)(p, x))

    @jax.jit
    def sharded(p, x):
        updates, _ = dist.update(jax.grad(_loss)(p, x), dist.init(p))
        return optax.apply_updates(p, updates)

    @jax.jit
    def shard_mapped(p, x):
        return apply(p, summed(p, x))

    pushed: list[int] = []
    start = _host.start

    def counted(names, average, priorities, mode, shard, *arrays, **kw):
        pushed.append(sum(a.nbytes for a in arrays))
        return start(names, average, priorities, mode, shard, *arrays, **kw)

    _host.start = counted
    result = {}
    for mode, fn, on in (
        ("local", local, mesh),
        ("sharded jit", sharded, mesh),
        ("shard_map", shard_mapped, auto),
    ):
        p = jax.device_put(params, NamedSharding(on, P()))
        x = jax.device_put(mine, NamedSharding(on, P("data")))
        seconds = _timed(lambda p, fn=fn, x=x: fn(p, x), p, args.steps)
        result[mode] = {"step_s": seconds, "bytes": max(pushed, default=0)}
        pushed.clear()
    print("RESULT " + json.dumps(result), flush=True)
    jaxps.shutdown()


def _pair(tmp, label, argv, envs) -> dict:
    """Runs two ranks of `argv`; returns rank 0's result (the ranks wait
    for each other at every step)."""
    with _common.children() as started:
        ranks = [
            _common.Child(f"{label}-{rank}", argv(rank), tmp, envs[rank])
            for rank in range(2)
        ]
        started.extend(ranks)
        return [json.loads(r.wait_for_line("RESULT ", 900)) for r in ranks][0]


def run(args, tmp: str, devices: int, width: int) -> dict:
    """Every path's rank-0 result at L=`devices`, `width`."""
    me = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps)]
    me += ["--width", str(width)]
    flag = f"--xla_force_host_platform_device_count={devices}"
    label = f"{devices}-{width}"
    with _common.children() as started:
        port = _common.free_port()
        server = _common.Child(
            f"server-{label}",
            ["jaxps-server", "--port", str(port), "--num-workers", "2"],
            tmp,
        )
        started.append(server)
        server.wait_for_line("jaxps-server listening", 60)
        envs = [
            {
                "XLA_FLAGS": flag,
                "JAXPS_SERVERS": f"{_common.LOOPBACK}:{port}",
                "JAXPS_NUM_WORKERS": "2",
                "JAXPS_WORKER_RANK": str(rank),
                "JAXPS_TIMEOUT": "120",
            }
            for rank in range(2)
        ]
        result = _pair(tmp, f"jaxps-{label}", lambda r: [*me, "--child"], envs)
    coordinator = f"{_common.LOOPBACK}:{_common.free_port()}"
    gloo = [*me, "--gloo", coordinator, "--local", str(devices)]
    result.update(
        _pair(
            tmp,
            f"gloo-{label}",
            lambda r: [*gloo, "--rank", str(r)],
            [{"XLA_FLAGS": ""}] * 2,
        )
    )
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.gloo:
        child_gloo(args)
        return 0
    began = time.monotonic()
    print(f"2 workers, 1 server, 127.0.0.1; {_common.load_average()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxps-multidevice-") as tmp:
        for devices in (int(d) for d in args.devices.split(",")):
            for width in (int(w) for w in args.widths.split(",")):
                result = run(args, tmp, devices, width)
                floor = result["local"]["step_s"]
                peer = result[PEER]["step_s"]
                for mode in (*MODES, PEER):
                    r = result[mode]
                    rows.append(
                        [
                            str(devices),
                            str(width),
                            mode,
                            f"{r['step_s'] * 1e3:.1f}",
                            f"{r['step_s'] / floor:.2f}x",
                            f"{peer / r['step_s']:.2f}x",
                            f"{r['bytes'] / _common.MB:.2f}",
                        ]
                    )
    print(
        _common.format_table(
            [
                "L",
                "width",
                "path",
                "ms/step",
                "time vs local",
                "speed vs jax gloo",
                "MiB/device",
            ],
            rows,
        )
    )
    print(f"took {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
