"""Synthetic-data training throughput of jaxps, in the style of BytePS.

Every step runs forward, backward (pushing each gradient to the summation
servers as soon as it is ready, `jaxps.value_and_grad`; `--no-overlap`
push_pulls them all after it instead) and an SGD update, on one fixed random
batch per worker.
After a few warm-up batches (which include compilation) it times
``--num-iters`` iterations of ``--num-batches-per-iter`` steps each, then
averages the ResNet's BatchNorm statistics over the workers.

    jaxps-launch --workers 2 --servers 2 -- \\
        python examples/benchmark.py --model resnet
    jaxps-launch --workers 2 --servers 2 -- \\
        python examples/benchmark.py --model transformer

It also runs as a single worker without servers: python examples/benchmark.py

On a host with several devices each worker shards its batch over all of
them (a mesh in context, ``jax.set_mesh``); jaxps pushes each device's
slice of the host's gradient, after the backward pass.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import time

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxps

NUM_CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)
VOCAB, SEQ_LEN = 1000, 32


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", choices=("resnet", "transformer"), default="resnet"
    )
    p.add_argument(
        "--batch-size", type=int, default=32, help="batch size per worker"
    )
    p.add_argument("--num-warmup-batches", type=int, default=3)
    p.add_argument("--num-batches-per-iter", type=int, default=5)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="push_pull all gradients after the backward pass "
        "(DistributedOptimizer) instead of during it (jaxps.value_and_grad)",
    )
    p.add_argument(
        "--bucket-kib",
        type=int,
        default=1024,
        help="overlapped path: gradients pushed together, KiB "
        "(jaxps.value_and_grad's bucket_bytes)",
    )
    return p.parse_args(argv)


class ResidualBlock(nnx.Module):
    """Two 3x3 conv + batch-norm layers with an identity (or 1x1) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int, rngs: nnx.Rngs):
        s = (stride, stride)
        self.conv1 = nnx.Conv(
            cin, cout, (3, 3), strides=s, use_bias=False, rngs=rngs
        )
        self.bn1 = nnx.BatchNorm(cout, rngs=rngs)
        self.conv2 = nnx.Conv(cout, cout, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(cout, rngs=rngs)
        # A 1x1 projection where the shape changes, else the identity.
        self.proj = (
            nnx.Conv(cin, cout, (1, 1), strides=s, use_bias=False, rngs=rngs)
            if stride != 1 or cin != cout
            else None
        )

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return nnx.relu(y + (x if self.proj is None else self.proj(x)))


class ResNet(nnx.Module):
    """A small ResNet: a stem, one block per stage (16/32/64), a head."""

    def __init__(self, rngs: nnx.Rngs, widths=(16, 32, 64)):
        self.stem = nnx.Conv(
            IMAGE_SHAPE[-1], widths[0], (3, 3), use_bias=False, rngs=rngs
        )
        self.bn = nnx.BatchNorm(widths[0], rngs=rngs)
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(ResidualBlock(cin, w, 1 if i == 0 else 2, rngs))
            cin = w
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(cin, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


class EncoderLayer(nnx.Module):
    """Pre-norm self-attention and MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.mlp1 = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.mlp2 = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp2(nnx.gelu(self.mlp1(self.norm2(x))))


class Transformer(nnx.Module):
    """A small encoder: token + position embeddings, layers, mean-pool."""

    def __init__(self, rngs: nnx.Rngs, dim=128, heads=4, depth=2):
        self.embed = nnx.Embed(VOCAB, dim, rngs=rngs)
        self.pos = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (SEQ_LEN, dim))
        )
        self.layers = nnx.List(
            [EncoderLayer(dim, heads, rngs) for _ in range(depth)]
        )
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, NUM_CLASSES, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(axis=1))


def synthetic_batch(model: str, batch_size: int, key):
    kx, ky = jax.random.split(key)
    if model == "resnet":
        x = jax.random.normal(kx, (batch_size, *IMAGE_SHAPE))
    else:
        x = jax.random.randint(kx, (batch_size, SEQ_LEN), 0, VOCAB)
    return x, jax.random.randint(ky, (batch_size,), 0, NUM_CLASSES)


def checksum(tree) -> str:
    """A short hash of the exact bytes of `tree`'s leaves."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:12]


def _loss(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@functools.partial(nnx.jit, static_argnames="bucket_bytes")
def train_step(model, optimizer, x, y, bucket_bytes=1 << 20):
    # each bucket's push starts in the backward pass; averaged on return
    loss, grads = jaxps.value_and_grad(_loss, bucket_bytes=bucket_bytes)(
        model, x, y
    )
    optimizer.update(model, grads)  # plain SGD
    return loss


@nnx.jit
def train_step_after_backward(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_loss)(model, x, y)
    optimizer.update(model, grads)  # DistributedOptimizer push_pulls them
    return loss


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    # Random keys built on XLA's RngBitGenerator compile several times faster
    # on CPU than the default threefry ones, which shortens the model set-up;
    # the initial values do not matter for a throughput benchmark.
    jax.config.update("jax_default_prng_impl", "rbg")
    jaxps.init()
    rank, size = jaxps.rank(), jaxps.size()

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    model_cls = ResNet if args.model == "resnet" else Transformer
    model = model_cls(nnx.Rngs(args.seed))
    nnx.update(model, jaxps.broadcast(nnx.state(model, nnx.Param)))
    tx = optax.sgd(0.01)
    step_fn = functools.partial(train_step, bucket_bytes=args.bucket_kib << 10)
    if args.no_overlap:
        step_fn = train_step_after_backward
        tx = jaxps.DistributedOptimizer(tx)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x, y = synthetic_batch(
        args.model, args.batch_size, jax.random.key(args.seed + rank)
    )
    # Several devices: the batch is sharded over them, the model replicated.
    devices = jax.local_device_count()
    mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,))
    if devices > 1:
        jax.set_mesh(mesh)  # for the rest of the program
        x, y = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    n_params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    log(f"Model: {args.model} ({n_params:,} parameters)")
    log(f"Batch size: {args.batch_size} per worker")
    log(f"Number of workers: {size} ({devices} device(s) each)")

    log("Running warmup...")
    start = time.perf_counter()
    for _ in range(args.num_warmup_batches):
        step_fn(model, optimizer, x, y)
    jax.block_until_ready(nnx.state(model))
    log(f"Warmup took {time.perf_counter() - start:.1f} s (with compilation)")

    log("Running benchmark...")
    rates = []
    for i in range(args.num_iters):
        start = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            loss = step_fn(model, optimizer, x, y)
        jax.block_until_ready((loss, nnx.state(model)))
        took = time.perf_counter() - start
        rates.append(args.batch_size * args.num_batches_per_iter / took)
        log(f"Iter #{i}: {rates[-1]:.1f} samples/sec per worker")

    # Each worker's BatchNorm running statistics come from its own batches;
    # average them before the model is evaluated or saved (the transformer
    # has none: a no-op). Outside the timed loop, so the rates are unchanged.
    before = checksum(nnx.state(model, nnx.BatchStat))
    jaxps.sync_batch_stats(model)
    if jax.tree.leaves(nnx.state(model, nnx.BatchStat)):
        after = checksum(nnx.state(model, nnx.BatchStat))
        print(f"batch stats checksum: {before} -> {after}", flush=True)

    mean, conf = float(np.mean(rates)), 1.96 * float(np.std(rates))
    log(f"Samples/sec per worker: {mean:.1f} +-{conf:.1f}")
    log(
        f"Total samples/sec on {size} worker(s): {size * mean:.1f} "
        f"+-{size * conf:.1f}"
    )
    jaxps.shutdown()
    return rates


if __name__ == "__main__":
    main()
