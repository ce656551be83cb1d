"""A jitted push_pull through the host callbacks: the op's own cost.

`pushpull.py` measures `jaxps.push_pull_numpy`, which skips JAX; this one
times ``jax.jit(jaxps.push_pull)`` of one float32 array per worker (2
workers, 1 server, 127.0.0.1, one device each), so the device-to-host
crossing and the callbacks are in the figure. Run it from two trees to
compare them (the peer is the other tree's run on the same machine)::

    python benchmarks/op.py --sizes-mb 4,64
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="4,64", help="MiB per worker")
    p.add_argument("--repeats", type=int, default=15, help="timed calls")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> None:
    import jax
    import jax.numpy as jnp

    import jaxps

    jaxps.init()
    result = {}
    for mb in (int(s) for s in args.sizes_mb.split(",")):
        x = jnp.full((mb * _common.MB // 4,), jaxps.rank() + 1.0)
        f = jax.jit(lambda t, mb=mb: jaxps.push_pull(t, name=f"op{mb}"))
        f(x).block_until_ready()
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            out = f(x)
            out.block_until_ready()
            times.append(time.perf_counter() - began)
        assert float(out[0]) == 1.5, float(out[0])  # mean of 1 and 2
        result[mb] = _common.median(times)
    print("RESULT " + json.dumps(result), flush=True)
    jaxps.shutdown()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    argv = [sys.executable, os.path.abspath(__file__), "--child"]
    argv += ["--sizes-mb", args.sizes_mb]
    argv += ["--repeats", str(args.repeats)]
    with tempfile.TemporaryDirectory(prefix="jaxps-op-") as tmp:
        results = _common.jaxps_job(
            argv, tmp, env={"XLA_FLAGS": ""}, timeout=600
        )
    rows = [
        [mb, f"{t * 1e3:.1f}", f"{int(mb) * _common.MB / t / 1e9:.2f}"]
        for mb, t in results[0].items()
    ]
    print(_common.format_table(["MiB", "ms per call", "GB/s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
