"""Data-parallel training of a small CNN on scikit-learn's 8x8 digits.

Each worker trains on its own 1/N slice of the training set; the gradients
are averaged over the workers by `jaxps.value_and_grad`, which starts each
gradient's push during the backward pass, so all workers keep identical
parameters (`--no-overlap`, `--compression` and `--async` use
`jaxps.DistributedOptimizer` / `AsyncDistributedOptimizer` instead). The
digits ship with scikit-learn, so nothing is downloaded.

Run it on one machine with 2 workers and 2 summation servers::

    jaxps-launch --workers 2 --servers 2 -- python examples/mnist.py

or as a single worker without servers::

    python examples/mnist.py --epochs 10

On a host with several devices each worker uses them all, the way JAX and
flax teach it: a mesh of its devices (``jax.set_mesh``), each batch sharded
over "data", one ``nnx.jit``; jaxps pushes each device's slice of the
host's gradient. Try it on CPU with forced devices::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        jaxps-launch --workers 2 --servers 2 -- python examples/mnist.py
"""

from __future__ import annotations

import argparse
import hashlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from tqdm import tqdm

import jaxps


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument(
        "--batch-size", type=int, default=32, help="batch size per worker"
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compression",
        default="none",
        choices=["none", "fp16", "bf16", "topk", "randomk", "onebit"],
        help="wire compression of the gradients",
    )
    p.add_argument(
        "--async",
        dest="async_mode",
        action="store_true",
        help="asynchronous training (launch with jaxps-launch --async)",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="average the gradients after the backward pass, in the optimizer",
    )
    p.add_argument(
        "--min-accuracy",
        type=float,
        default=0.0,
        help="exit 1 if the test accuracy is below this",
    )
    return p.parse_args(argv)


def load_data(rank: int, size: int):
    """This worker's training slice and the full test set, standardized."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=0.2, random_state=0
    )
    scaler = StandardScaler().fit(x_train)
    x_train, x_test = (
        scaler.transform(x).astype(np.float32).reshape(-1, 8, 8, 1)
        for x in (x_train, x_test)
    )
    # Each worker keeps every size-th example, starting at its rank.
    return (
        (x_train[rank::size], y_train[rank::size]),
        (x_test, y_test),
        len(x_train),
    )


class CNN(nnx.Module):
    """conv3x3(16) -> conv3x3(32) -> avg-pool 2x2 -> dense(64) -> dense(10)."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
        self.dense1 = nnx.Linear(4 * 4 * 32, 64, rngs=rngs)
        self.dense2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv1(x))
        x = nnx.relu(self.conv2(x))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nnx.relu(self.dense1(x.reshape(x.shape[0], -1)))
        return self.dense2(x)


def loss_fn(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nnx.jit
def train_step(model, optimizer, x, y):
    # pushes each gradient as soon as the backward pass has it; the
    # gradients come back averaged over the workers
    loss, grads = jaxps.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)  # a plain optax optimizer
    return loss


@nnx.jit
def train_step_after_backward(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)  # DistributedOptimizer: push_pulls first
    return loss


@nnx.jit
def predict(model, x):
    return jnp.argmax(model(x), axis=-1)


def checksum(model) -> str:
    """A short hash of the exact parameter bytes."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:12]


def make_compression(name: str):
    """The wire compression called `name` (sparse ones keep 1%)."""
    c = jaxps.compression
    return {
        "none": None,
        "fp16": c.fp16(),
        "bf16": c.bf16(),
        "topk": c.topk(0.01),
        "randomk": c.randomk(0.01),
        "onebit": c.onebit(),
    }[name]


def main(argv=None) -> float:
    args = parse_args(argv)
    jaxps.init()
    rank, size = jaxps.rank(), jaxps.size()
    (x_train, y_train), (x_test, y_test), n_total = load_data(rank, size)

    # Different seeds on purpose: broadcast makes rank 0's init win.
    model = CNN(nnx.Rngs(args.seed + rank))
    if not args.async_mode:  # async servers hand out rank 0's init instead
        nnx.update(model, jaxps.broadcast(nnx.state(model, nnx.Param)))
        print(f"params checksum after broadcast: {checksum(model)}", flush=True)

    overlap = not (
        args.async_mode or args.no_overlap or args.compression != "none"
    )
    step_fn = train_step if overlap else train_step_after_backward
    if overlap:
        tx = optax.adam(args.lr)
    elif args.async_mode:
        tx = jaxps.AsyncDistributedOptimizer(optax.adam(args.lr))
    else:
        tx = jaxps.DistributedOptimizer(
            optax.adam(args.lr), compression=make_compression(args.compression)
        )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    # Several devices: the batch is sharded over them, the model replicated;
    # XLA reduces the gradients over the devices, then each pushes 1/L.
    devices = jax.local_device_count()
    if args.batch_size % devices:
        raise SystemExit(
            f"--batch-size {args.batch_size} must be a multiple of this "
            f"host's {devices} devices"
        )
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,))
    batch = NamedSharding(mesh, P("data"))
    if devices > 1:
        jax.set_mesh(mesh)  # for the rest of the program

    # Every worker must run the same number of steps (each one push_pulls),
    # so it is computed from the smallest slice; last partial batch dropped.
    steps = (n_total // size) // args.batch_size
    rng = np.random.default_rng(args.seed + 1000 * rank)
    bar = tqdm(total=args.epochs * steps, disable=rank != 0, unit="step")
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_train))
        losses = []
        for i in range(steps):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            x, y = jax.device_put((x_train[idx], y_train[idx]), batch)
            losses.append(step_fn(model, optimizer, x, y))
            bar.update()
        if rank == 0:
            bar.write(
                f"epoch {epoch + 1}: loss {np.mean(losses):.4f} "
                f"({time.perf_counter() - start:.1f} s)"
            )
    bar.close()

    accuracy = float(np.mean(np.asarray(predict(model, x_test)) == y_test))
    print(
        f"trained {args.epochs} epochs on {size} worker(s) in "
        f"{time.perf_counter() - start:.1f} s",
        flush=True,
    )
    print(f"test accuracy: {accuracy:.3f}", flush=True)
    print(f"params checksum after training: {checksum(model)}", flush=True)
    jaxps.shutdown()
    if accuracy < args.min_accuracy:
        raise SystemExit(1)
    return accuracy


if __name__ == "__main__":
    main()
