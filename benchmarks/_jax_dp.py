"""JAX-native data parallelism: the peer of jaxps in ``benchmarks/train.py``.

One process per worker, each with one CPU device, joined by
``jax.distributed.initialize`` with gloo CPU collectives. The model, batch,
loss and SGD step are those of ``examples/benchmark.py`` (imported, not
copied); the step is one jitted ``jax.shard_map`` over the global mesh of
one device per process whose gradients are averaged by ``lax.pmean`` (a
psum over gloo) before the update. BatchNorm statistics stay local, as in
the jaxps example.

    python benchmarks/_jax_dp.py --coordinator 127.0.0.1:PORT \\
        --num-workers N --rank R [--my-ip 127.0.0.1] [--model resnet]

Prints ``TRAIN_RESULT {json}``: the samples/sec per worker of each timed
iteration (as the example's ``main`` returns them), the CPU cores the
process used meanwhile, and a checksum of the final parameters (the same on
every rank if the gradients were averaged).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
RESULT = "TRAIN_RESULT "
TIMEOUT = 120  # seconds for initialize


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", required=True, help="HOST:PORT")
    p.add_argument("--num-workers", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument(
        "--my-ip",
        default="127.0.0.1",
        help="address gloo listens on and tells its peers",
    )
    p.add_argument(
        "--model", choices=("resnet", "transformer"), default="resnet"
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--batches-per-iter", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 1)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # as examples/benchmark.py does (faster to compile; same for all ranks)
    jax.config.update("jax_default_prng_impl", "rbg")
    sys.path.insert(0, HERE)
    from cluster import _bind_gloo  # gloo on --my-ip, not the hostname's

    _bind_gloo(args.my_ip)
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        coordinator_bind_address=args.coordinator,
        num_processes=args.num_workers,
        process_id=args.rank,
        initialization_timeout=TIMEOUT,
        shutdown_timeout_seconds=60,
    )
    import numpy as np
    import optax
    from flax import nnx
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, EXAMPLES)
    import benchmark  # the example: models, batch, loss

    n = args.num_workers
    devices = jax.devices()
    assert len(devices) == n, f"{len(devices)} global devices, want {n}"
    mesh = Mesh(np.array(devices), ("x",))
    (device,) = jax.local_devices()

    model_cls = (
        benchmark.ResNet if args.model == "resnet" else benchmark.Transformer
    )
    model = model_cls(nnx.Rngs(args.seed))  # same seed: same start everywhere
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.sgd(0.01)
    opt_state = tx.init(params)
    x, y = benchmark.synthetic_batch(
        args.model, args.batch_size, jax.random.key(args.seed + args.rank)
    )

    def local_step(params, rest, opt_state, x, y):
        model = nnx.merge(graphdef, params, rest)
        # the example's loss and gradients (nnx.value_and_grad), local batch
        loss, grads = nnx.value_and_grad(benchmark._loss)(model, x, y)
        grads = jax.lax.pmean(grads, "x")  # the all-reduce, over gloo
        _, params, rest = nnx.split(model, nnx.Param, ...)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss

    # Parameters and optimizer state are replicated (the same on every
    # device after the pmean); BatchNorm statistics and the loss stay each
    # worker's own, so replication is not checked (check_vma=False).
    step = jax.jit(
        jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(P(), P(), P(), P("x"), P("x")),
            out_specs=(P(), P(), P(), P()),
            check_vma=False,
        ),
        donate_argnums=(0, 1, 2),
    )

    def global_array(local, spec):
        local = np.asarray(local)
        shape = local.shape if spec == P() else (n * local.shape[0],)
        shape += local.shape[len(shape) :]
        return jax.make_array_from_single_device_arrays(
            shape, NamedSharding(mesh, spec), [jax.device_put(local, device)]
        )

    def replicated(tree):
        return jax.tree.map(lambda a: global_array(a, P()), tree)

    params, rest, opt_state = (replicated(t) for t in (params, rest, opt_state))
    gx, gy = global_array(x, P("x")), global_array(y, P("x"))
    n_params = sum(p.size for p in jax.tree.leaves(params))
    if args.rank == 0:
        print(f"Model: {args.model} ({n_params:,} parameters)", flush=True)

    for _ in range(args.warmup):
        params, rest, opt_state, loss = step(params, rest, opt_state, gx, gy)
    jax.block_until_ready((params, rest, loss))
    multihost_utils.sync_global_devices("timed")

    # rank 0: the cores of everything train.py started, and of the rest
    root = os.environ.get("TRAIN_ROOT_PID") if args.rank == 0 else None
    if root:
        from train import cpu_seconds
    rates = []
    cpu, wall = time.process_time(), time.time()
    proc = cpu_seconds(int(root)) if root else None
    for _ in range(args.iters):
        start = time.perf_counter()
        for _ in range(args.batches_per_iter):
            params, rest, opt_state, loss = step(
                params, rest, opt_state, gx, gy
            )
        jax.block_until_ready((params, rest, loss))
        took = time.perf_counter() - start
        rates.append(args.batch_size * args.batches_per_iter / took)
    elapsed = time.time() - wall
    cores = (time.process_time() - cpu) / elapsed
    extra = {}
    if proc is not None:
        machine, ours = (b - a for a, b in zip(proc, cpu_seconds(int(root))))
        extra["job_cores"] = ours / elapsed
        extra["other_cores"] = max(0.0, machine - ours) / elapsed
    local = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), params)
    result = {
        "rank": args.rank,
        "rates": rates,
        "cores": cores,
        "params": benchmark.checksum(local),
        **extra,
    }
    multihost_utils.sync_global_devices("done")
    jax.distributed.shutdown()
    print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
