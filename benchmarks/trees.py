"""The gradient trees of real models: jaxps against JAX's gloo all-reduce
of the same tree, and against one leaf of the same bytes, in the same run.

ResNet-50 has 161 parameter tensors (25.6 M floats), BERT-base 199
(109.5 M); only their shapes are used. Two workers on 127.0.0.1, one
device each:

* jaxps: 2 servers; each worker times ``jax.jit(jaxps.push_pull)`` of the
  tree, of one float32 leaf of the same bytes, and (the floor any jitted
  step with that many inputs and outputs pays) ``jax.jit`` of ``x * 1.5``
  over the tree;
* jax-gloo: ``jax.distributed`` with 2 processes, and a jitted
  ``shard_map`` ``psum`` of the tree over the 2 global devices.

::

    python benchmarks/trees.py [--trees resnet50,bert-base] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def resnet50() -> list[tuple[int, ...]]:
    """Parameter shapes of ResNet-50 (kernels HWIO, batch-norm scale and
    bias, the classifier), in forward order."""
    shapes = [(7, 7, 3, 64), (64,), (64,)]
    width_in = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            convs = [
                (1, 1, width_in, width),
                (3, 3, width, width),
                (1, 1, width, 4 * width),
            ]
            if block == 0:  # the projection of the shortcut
                convs.append((1, 1, width_in, 4 * width))
            for kernel in convs:
                shapes += [kernel, (kernel[-1],), (kernel[-1],)]
            width_in = 4 * width
    return shapes + [(2048, 1000), (1000,)]


def bert_base() -> list[tuple[int, ...]]:
    """Parameter shapes of BERT-base (embeddings, 12 layers, pooler)."""
    d, ff = 768, 3072
    shapes = [(30522, d), (512, d), (2, d), (d,), (d,)]
    for _ in range(12):
        shapes += [(d, d), (d,)] * 4  # query, key, value, attention output
        shapes += [(d,), (d,), (d, ff), (ff,), (ff, d), (d,), (d,), (d,)]
    return shapes + [(d, d), (d,)]


TREES = {"resnet50": resnet50, "bert-base": bert_base}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", default="resnet50,bert-base")
    p.add_argument("--repeats", type=int, default=5, help="timed calls")
    p.add_argument("--role", choices=("jaxps", "gloo"), help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _tree(name: str, rank: int):
    """The model's tree of float32 leaves, each filled with rank + 1."""
    import jax.numpy as jnp

    return {
        f"p{i:03d}": jnp.full(shape, rank + 1.0, jnp.float32)
        for i, shape in enumerate(TREES[name]())
    }


def _timed(fn, arg, repeats: int, barrier) -> float:
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(arg))
    times = []
    for _ in range(repeats):
        barrier()
        began = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - began)
    return _common.median(times)


def jaxps_worker(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxps

    jaxps.init()
    tick = np.zeros(1, np.float32)

    def barrier():
        jaxps.push_pull_numpy("barrier", tick, average=False)

    result = {}
    for name in args.trees.split(","):
        tree = _tree(name, jaxps.rank())
        floats = sum(math.prod(leaf.shape) for leaf in tree.values())
        one = jnp.full((floats,), jaxps.rank() + 1.0, jnp.float32)
        pushed = jax.jit(lambda t, n=name: jaxps.push_pull(t, name=n))
        alone = jax.jit(lambda t: jax.tree.map(lambda x: x * 1.5, t))
        result[name] = {
            "tree": _timed(pushed, tree, args.repeats, barrier),
            "one leaf": _timed(pushed, one, args.repeats, barrier),
            "jit alone": _timed(alone, tree, args.repeats, barrier),
        }
        out = pushed(tree)
        assert float(out["p000"].ravel()[0]) == 1.5, out["p000"]
        del tree, one, out
    jaxps.shutdown()
    return result


def gloo_worker(args) -> dict:
    import jax
    import numpy as np

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = f"{_common.LOOPBACK}:{args.port}"
    jax.distributed.initialize(
        coordinator_address=address,
        coordinator_bind_address=address,
        num_processes=2,
        process_id=args.rank,
    )
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    psum = jax.jit(
        jax.shard_map(
            lambda t: jax.tree.map(lambda v: jax.lax.psum(v, "x"), t),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P("x"),
        )
    )
    (device,) = jax.local_devices()

    def barrier():
        multihost_utils.sync_global_devices("trees")

    result = {}
    for name in args.trees.split(","):
        tree = {
            key: jax.make_array_from_single_device_arrays(
                (2, *leaf.shape), sharding, [jax.device_put(leaf[None], device)]
            )
            for key, leaf in _tree(name, args.rank).items()
        }
        result[name] = {"tree": _timed(psum, tree, args.repeats, barrier)}
        got = psum(tree)["p000"].addressable_shards[0].data
        assert float(got.ravel()[0]) == 3.0, got
        del tree
    jax.distributed.shutdown()
    return result


def _argv(args, role: str) -> list[str]:
    return [
        sys.executable,
        os.path.abspath(__file__),
        "--role",
        role,
        "--trees",
        args.trees,
        "--repeats",
        str(args.repeats),
    ]


def _gloo(args, log_dir: str) -> list[dict]:
    port = _common.free_port()
    env = {"JAX_PLATFORMS": "cpu", "GLOO_SOCKET_IFNAME": "lo", "XLA_FLAGS": ""}
    with _common.children() as started:
        ranks = [
            _common.Child(
                f"gloo{rank}",
                [*_argv(args, "gloo"), "--rank", str(rank)]
                + ["--port", str(port)],
                log_dir,
                env,
            )
            for rank in range(2)
        ]
        started.extend(ranks)
        return [json.loads(r.wait_for_line("RESULT ", 900)) for r in ranks]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.role:
        worker = jaxps_worker if args.role == "jaxps" else gloo_worker
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="jaxps-trees-") as tmp:
        ours = _common.jaxps_job(
            _argv(args, "jaxps"), tmp, servers=2, env={"XLA_FLAGS": ""}
        )
        theirs = _gloo(args, tmp)

    def slower(results, name, what):
        return max(r[name][what] for r in results)

    rows = []
    for name in args.trees.split(","):
        shapes = TREES[name]()
        mb = sum(math.prod(s) for s in shapes) * 4 / 1e6
        tree = slower(ours, name, "tree")
        one = slower(ours, name, "one leaf")
        alone = slower(ours, name, "jit alone")
        gloo = slower(theirs, name, "tree")
        rows.append(
            [
                name,
                str(len(shapes)),
                f"{mb:.1f}",
                f"{tree * 1e3:.0f}",
                f"{one * 1e3:.0f}",
                f"{tree / one:.2f}",
                f"{alone * 1e3:.1f}",
                f"{gloo * 1e3:.0f}",
                f"{gloo / tree:.2f}x",
            ]
        )
    header = [
        "tree",
        "leaves",
        "MB",
        "jaxps ms",
        "1 leaf ms",
        "x 1 leaf",
        "jit alone ms",
        "gloo ms",
        "jaxps vs gloo",
    ]
    print(_common.format_table(header, rows))
    print(
        f"(median of {args.repeats} calls, slower rank; 2 workers, jaxps "
        f"with 2 servers; load average {_common.load_average()})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
