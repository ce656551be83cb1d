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

and prints each path's median step time and its ratio to ``local``, with
the bytes each device pushed per step. On this 2-core machine 8 worker
devices share 2 cores: the figures compare the paths, not the hardware.

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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="2,4", help="L values, comma list")
    p.add_argument("--widths", default="1024,2048", help="layer widths")
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=1024, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxps
    from jaxps.ops import _host

    jaxps.init()
    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), ("data",))
    rng = np.random.default_rng(jaxps.rank())
    w = args.width
    params = {
        "w1": rng.standard_normal((w, w)).astype(np.float32) / np.sqrt(w),
        "w2": rng.standard_normal((w, w)).astype(np.float32) / np.sqrt(w),
    }
    x = rng.standard_normal((16 * devices, w)).astype(np.float32)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    tx = optax.sgd(0.01)

    def loss(p, x):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

    def apply(p, grads):
        return jax.tree.map(lambda a, g: a - 0.01 * g, p, grads)

    @jax.jit
    def local(p, x):
        return apply(p, jax.grad(loss)(p, x))

    dist = jaxps.DistributedOptimizer(tx, name="sharded")
    state = dist.init(params)

    @jax.jit
    def sharded(p, state, x):
        updates, state = dist.update(jax.grad(loss)(p, x), state)
        return optax.apply_updates(p, updates), state

    auto = jax.make_mesh(
        (devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    summed = jax.shard_map(
        lambda p, x: jaxps.push_pull(
            jax.grad(loss)(p, x), axis_name="data", name="sm"
        ),
        mesh=auto,
        in_specs=(P(), P("data")),
        out_specs=P(),
    )

    @jax.jit
    def shard_mapped(p, x):
        return apply(p, summed(p, x))

    pushed: list[int] = []
    start = _host.start

    def counted(names, average, priorities, mode, shard, *arrays, **kw):
        pushed.append(sum(a.nbytes for a in arrays))
        return start(names, average, priorities, mode, shard, *arrays, **kw)

    _host.start = counted
    p_auto = jax.device_put(params, NamedSharding(auto, P()))
    x_auto = jax.device_put(x, NamedSharding(auto, P("data")))
    runs = {
        "local": lambda p: (local(p, x), None),
        "sharded jit": lambda p: sharded(p, state, x),
        "shard_map": lambda p: (shard_mapped(p, x_auto), None),
    }
    start_params = {"local": params, "sharded jit": params}
    start_params["shard_map"] = p_auto
    result = {}
    for mode in MODES:
        p = start_params[mode]
        for _ in range(2):  # compile, warm up
            p, _ = runs[mode](p)
        jax.block_until_ready(p)
        pushed.clear()
        times = []
        for _ in range(args.steps):
            began = time.perf_counter()
            p, _ = runs[mode](p)
            jax.block_until_ready(p)
            times.append(time.perf_counter() - began)
        per_device = max(pushed) if pushed else 0
        result[mode] = {"step_s": _common.median(times), "bytes": per_device}
    print("RESULT " + json.dumps(result), flush=True)
    jaxps.shutdown()


def run(args, tmp: str, devices: int, width: int) -> dict:
    with _common.children() as started:
        port = _common.free_port()
        server = _common.Child(
            f"server-{devices}-{width}",
            ["jaxps-server", "--port", str(port), "--num-workers", "2"],
            tmp,
        )
        started.append(server)
        server.wait_for_line("jaxps-server listening", 60)
        ranks = []
        for rank in range(2):
            flag = f"--xla_force_host_platform_device_count={devices}"
            env = {
                "XLA_FLAGS": flag,
                "JAXPS_SERVERS": f"{_common.LOOPBACK}:{port}",
                "JAXPS_NUM_WORKERS": "2",
                "JAXPS_WORKER_RANK": str(rank),
                "JAXPS_TIMEOUT": "120",
            }
            argv = [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                "--width",
                str(width),
                "--steps",
                str(args.steps),
            ]
            ranks.append(
                _common.Child(f"w{rank}-{devices}-{width}", argv, tmp, env)
            )
        started.extend(ranks)
        results = [json.loads(r.wait_for_line("RESULT ", 900)) for r in ranks]
    return results[0]  # rank 0's timings (the ranks wait for each other)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    began = time.monotonic()
    print(f"2 workers, 1 server, 127.0.0.1; {_common.load_average()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxps-multidevice-") as tmp:
        for devices in (int(d) for d in args.devices.split(",")):
            for width in (int(w) for w in args.widths.split(",")):
                result = run(args, tmp, devices, width)
                floor = result["local"]["step_s"]
                for mode in MODES:
                    r = result[mode]
                    rows.append(
                        [
                            str(devices),
                            str(width),
                            mode,
                            f"{r['step_s'] * 1e3:.1f}",
                            f"{r['step_s'] / floor:.2f}x",
                            f"{r['bytes'] / _common.MB:.2f}",
                        ]
                    )
    print(
        _common.format_table(
            ["L", "width", "path", "ms/step", "vs local", "MiB/device"], rows
        )
    )
    print(f"took {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
