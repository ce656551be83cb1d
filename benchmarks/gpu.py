"""The device path on one accelerator (or the CPU): step cost and D2H route.

One command, on a GPU host and on CPU alike::

    python benchmarks/gpu.py            # a few minutes
    python benchmarks/gpu.py --quick    # CI: a small model, one size

It prints, each against its peer measured in the same run:

1. a transformer step with `jax.value_and_grad` alone against the same step
   with `jaxps.value_and_grad` through a local server, with 1 worker and
   with 2 workers sharing the device, and the host callbacks per step;
2. the device-to-host route jaxps uses (its host callback copying the
   operand) in ms and GB/s, against `jax.device_get` of the same bytes and
   against a `jax.device_put` to ``memory_kind="pinned_host"`` (n/a where
   the backend has no such memory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="a small model and size, for CI"
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--dim", type=int, default=None, help="model width")
    p.add_argument("--depth", type=int, default=None, help="layers")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument(
        "--sizes-mb", default=None, help="D2H sizes in MiB, comma separated"
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return args


#: Model and sizes: the quick run (CI), and the full one per platform (a
#: step of about 0.5-1 s on 2 CPU cores; a larger model on an accelerator),
#: so that the full run stays within about 5 minutes on either.
SIZES = {
    "quick": {"steps": 5, "dim": 128, "depth": 2, "batch": 16},
    "cpu": {"steps": 8, "dim": 384, "depth": 4, "batch": 16},
    "accelerator": {"steps": 20, "dim": 1024, "depth": 8, "batch": 32},
}
D2H_MB = {"quick": "4", "cpu": "4,64,256", "accelerator": "4,64,256"}


def fill_sizes(args, platform: str) -> None:
    """Fills the options left out from `SIZES` for `platform`."""
    kind = "quick" if args.quick else platform
    kind = kind if kind in ("quick", "cpu") else "accelerator"
    for key, value in SIZES[kind].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.sizes_mb is None:
        args.sizes_mb = D2H_MB[kind]


# ---- the step (child processes) ---------------------------------------------


def _model(args):
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    dims = [args.dim] * (args.depth + 1)
    params = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        params.append(
            {
                "qkv": jax.random.normal(k1, (a, 3 * b)) / np.sqrt(a),
                "mlp": jax.random.normal(k2, (b, 4 * b)) / np.sqrt(b),
                "out": jax.random.normal(k2, (4 * b, b)) / np.sqrt(4 * b),
                "norm": jnp.ones(b),
            }
        )
    x = jax.random.normal(key, (args.batch, 64, args.dim))
    return params, x


def _loss(params, x):
    import jax
    import jax.numpy as jnp

    for layer in params:
        q, k, v = jnp.split(x @ layer["qkv"], 3, axis=-1)
        att = jax.nn.softmax(q @ k.swapaxes(1, 2) / np.sqrt(q.shape[-1]))
        x = x + att @ v
        h = x * layer["norm"] / (jnp.std(x, -1, keepdims=True) + 1e-5)
        x = x + jax.nn.gelu(h @ layer["mlp"]) @ layer["out"]
    return jnp.mean(x**2)


def child(args) -> None:
    import jax
    import optax

    mode = args.child
    params, x = _model(args)
    tx = optax.sgd(1e-3)
    counts = {"callbacks": 0}
    if mode == "jaxps":
        import jaxps
        from jaxps.ops import _callback

        jaxps.init()
        lower = _callback._lowering

        def counted(ctx, *operands, fn, **params):
            def wrapped(*a):
                counts["callbacks"] += 1
                return fn(*a)

            return lower(ctx, *operands, fn=wrapped, **params)

        jax.interpreters.mlir.register_lowering(
            _callback._call_p, counted, cacheable=False
        )
        grad = jaxps.value_and_grad(_loss)
    else:
        grad = jax.value_and_grad(_loss)

    @jax.jit
    def step(params, state, x):
        loss, grads = grad(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state = tx.init(params)
    for _ in range(2):  # compile, warm up
        params, state, loss = step(params, state, x)
    loss.block_until_ready()
    counts["callbacks"] = 0
    times = []
    for _ in range(args.steps):
        began = time.perf_counter()
        params, state, loss = step(params, state, x)
        loss.block_until_ready()
        times.append(time.perf_counter() - began)
    leaves = jax.tree.leaves(params)
    print(
        "RESULT "
        + json.dumps(
            {
                "step_s": _common.median(times),
                "callbacks_per_step": counts["callbacks"] / args.steps,
                "leaves": len(leaves),
                "bytes": sum(leaf.nbytes for leaf in leaves),
                "device": str(jax.devices()[0].platform),
            }
        ),
        flush=True,
    )
    if mode == "jaxps":
        import jaxps

        jaxps.shutdown()


def child_argv(args, mode: str) -> list[str]:
    return [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        mode,
        "--steps",
        str(args.steps),
        "--dim",
        str(args.dim),
        "--depth",
        str(args.depth),
        "--batch",
        str(args.batch),
    ]


def run_steps(args, tmp: str, workers: int) -> list[dict]:
    """Step results of `workers` jaxps workers (a local server) and of the
    same step without jaxps, run one after the other."""
    results = []
    with _common.children() as started:
        env = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
        plain = _common.Child("plain", child_argv(args, "plain"), tmp, env)
        started.append(plain)
        results.append(("plain", 1, _result(plain)))
        port = _common.free_port()
        server = _common.Child(
            f"server{workers}",
            [
                "jaxps-server",
                "--port",
                str(port),
                "--num-workers",
                str(workers),
            ],
            tmp,
        )
        started.append(server)
        server.wait_for_line("jaxps-server listening", 60)
        ranks = []
        for rank in range(workers):
            ranks.append(
                _common.Child(
                    f"jaxps{workers}-{rank}",
                    child_argv(args, "jaxps"),
                    tmp,
                    dict(
                        env,
                        JAXPS_SERVERS=f"{_common.LOOPBACK}:{port}",
                        JAXPS_NUM_WORKERS=str(workers),
                        JAXPS_WORKER_RANK=str(rank),
                        JAXPS_TIMEOUT="120",
                    ),
                )
            )
        started.extend(ranks)
        for proc in ranks:
            results.append(("jaxps", workers, _result(proc)))
    return results


def _result(proc) -> dict:
    line = proc.wait_for_line("RESULT ", 600)
    return json.loads(line)


# ---- the device-to-host route (this process) ---------------------------------


def _route_times(x, through_callback, repeats: int) -> dict:
    """Median seconds of each device-to-host route for the array `x`."""
    import jax

    timings = {}
    routes = {
        "jaxps callback": lambda: through_callback(x).block_until_ready(),
        "device_get": lambda: jax.device_get(x),
    }
    try:
        pinned = x.sharding.with_memory_kind("pinned_host")
        jax.device_put(x, pinned).block_until_ready()
        routes["pinned_host put"] = lambda: jax.device_put(
            x, pinned
        ).block_until_ready()
    except Exception as err:  # noqa: BLE001 - reported as n/a
        timings["pinned_host put"] = f"n/a ({type(err).__name__})"
    for name, fn in routes.items():
        fn()  # compile, first touch
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        timings[name] = _common.median(times)
    return timings


def d2h(sizes_mb: list[int], repeats: int = 5) -> list[list[str]]:
    import jax
    import jax.numpy as jnp

    from jaxps.ops import _callback, _host

    def keep(a):
        _host._kept(a, from_callback=True)  # what the start callback keeps
        return np.int32(0)

    @jax.jit
    def through_callback(x):
        return _callback.call(keep, jax.ShapeDtypeStruct((), jnp.int32), x)

    rows = []
    for mb in sizes_mb:
        x = jnp.ones((mb * _common.MB // 4,), jnp.float32) * 1.5
        x.block_until_ready()
        timings = _route_times(x, through_callback, repeats)
        base = timings["device_get"]
        for name, t in timings.items():
            if isinstance(t, str):
                rows.append([f"{mb} MiB", name, t, "", ""])
                continue
            rows.append(
                [
                    f"{mb} MiB",
                    name,
                    f"{t * 1e3:.2f}",
                    f"{mb * _common.MB / t / 1e9:.2f}",
                    f"{base / t:.2f}x",
                ]
            )
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    import tempfile

    import jax

    began = time.monotonic()
    device = jax.devices()[0]
    fill_sizes(args, device.platform)
    print(
        f"device: {device.platform} ({device.device_kind}), jax "
        f"{jax.__version__}; {_common.load_average()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="jaxps-gpu-") as tmp:
        rows = []
        for workers in (1, 2):
            results = run_steps(args, tmp, workers)
            plain = results[0][2]
            for kind, n, r in results:
                rows.append(
                    [
                        kind if kind == "plain" else f"jaxps, {n} worker(s)",
                        f"{r['step_s'] * 1e3:.1f}",
                        f"{r['step_s'] / plain['step_s']:.2f}x",
                        f"{r['callbacks_per_step']:.0f}",
                        str(r["leaves"]),
                        f"{r['bytes'] / _common.MB:.1f}",
                    ]
                )
    print(
        f"\nTransformer step: width {args.dim}, {args.depth} layers, batch "
        f"{args.batch}x64, {args.steps} timed steps (median ms; ratio to the "
        "plain step of the same pass)"
    )
    print(
        _common.format_table(
            ["step", "ms", "vs plain", "callbacks", "leaves", "MiB"], rows
        )
    )
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    print("\nDevice to host (median of 5; ratio: device_get time / route's)")
    print(
        _common.format_table(
            ["bytes", "route", "ms", "GB/s", "vs device_get"], d2h(sizes)
        )
    )
    print(f"\ntook {time.monotonic() - began:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
