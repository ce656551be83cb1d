"""One jaxps worker running JAX-level checks; started once per rank.

Run by test_push_pull.py as ``python scenarios.py NAME...`` with the JAXPS_*
environment of a job. Each scenario asserts against a result computed here
from every rank's (deterministic) contribution, and prints ``ok NAME``.
"""

import os
import re
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxps  # noqa: E402

RTOL = 1e-5


def contribution(rank, shape, dtype=np.float32):
    size = int(np.prod(shape))
    return (np.arange(size).reshape(shape) % 7 + 10 * rank).astype(dtype)


def total(shape, dtype=np.float32):
    return sum(
        contribution(r, shape, np.float64) for r in range(jaxps.size())
    ).astype(dtype)


def check_jit():
    tree = {
        "a": contribution(jaxps.rank(), (3, 5)),
        "b": contribution(jaxps.rank(), (1001,), np.float64),
    }
    f = jax.jit(lambda t: jaxps.push_pull(t, average=False, name="jit"))
    for _ in range(3):  # several rounds of the same compiled program
        out = f(tree)
        np.testing.assert_allclose(out["a"], total((3, 5)), rtol=RTOL)
        np.testing.assert_allclose(out["b"], total((1001,), np.float64))
    avg = jax.jit(lambda t: jaxps.push_pull(t, name="jitavg"))(tree)
    np.testing.assert_allclose(
        avg["a"], total((3, 5)) / jaxps.size(), rtol=RTOL
    )
    ints = jaxps.push_pull(
        contribution(jaxps.rank(), (4,), np.int32), average=False, name="ints"
    )
    np.testing.assert_array_equal(ints, total((4,), np.int32))


def check_grad():
    x = jnp.asarray(contribution(jaxps.rank(), (6,)))

    def loss(v):
        return jnp.sum(jaxps.push_pull(v, average=False, name="g") ** 2)

    g = jax.jit(jax.grad(loss))(x)
    # d/dx_r sum((sum_s x_s)^2) = sum over workers of 2 * sum_s x_s
    expected = 2 * total((6,)) * jaxps.size()
    np.testing.assert_allclose(g, expected, rtol=RTOL)


def check_unused_result():
    # A push_pull whose result is unused (a barrier) still pushes: the other
    # ranks wait for it. Rank 0 drops the result, the others use it.
    x = jnp.asarray(contribution(jaxps.rank(), (4,)))

    def dropped(v):
        jaxps.push_pull(v, average=False, name="barrier")
        return v * 2

    def used(v):
        return jaxps.push_pull(v, average=False, name="barrier")

    f = jax.jit(dropped if jaxps.rank() == 0 else used)
    for _ in range(2):
        out = f(x)
        if jaxps.rank() != 0:
            np.testing.assert_allclose(out, total((4,)), rtol=RTOL)


def check_remat():
    # Under jax.checkpoint a push_pull runs once per step, not again in the
    # backward pass: rank 0 remats, the others do not, and the rounds of
    # every rank stay in step.
    x = jnp.asarray(contribution(jaxps.rank(), (6,)))

    def body(v):
        return jnp.sin(jaxps.push_pull(v, average=False, name="remat"))

    if jaxps.rank() == 0:
        body = jax.checkpoint(body)
    step = jax.jit(jax.value_and_grad(lambda v: jnp.sum(body(v))))
    for _ in range(3):
        value, grad = step(x)
        np.testing.assert_allclose(value, np.sum(np.sin(total((6,)))), 1e-4)
        # the transpose sums every rank's cotangent cos(S)
        expected = jaxps.size() * np.cos(total((6,)))
        np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-5)


def check_default_names():
    # Default names never collide: two push_pulls of one jitted step, from
    # one helper or from one line, and two DistributedOptimizers.
    def allreduce(x):
        return jaxps.push_pull(x, average=False)

    loss = jnp.asarray(contribution(jaxps.rank(), (2,)))
    acc = jnp.asarray(contribution(jaxps.rank(), (2,)) * 2)

    @jax.jit
    def metrics(loss, acc):
        same_line = jaxps.push_pull(loss), jaxps.push_pull(acc)
        return allreduce(loss), allreduce(acc), same_line

    for _ in range(2):
        summed_loss, summed_acc, (mean_loss, mean_acc) = metrics(loss, acc)
        np.testing.assert_allclose(summed_loss, total((2,)), rtol=RTOL)
        np.testing.assert_allclose(summed_acc, 2 * total((2,)), rtol=RTOL)
        np.testing.assert_allclose(
            mean_acc, 2 * total((2,)) / jaxps.size(), rtol=RTOL
        )
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.asarray(contribution(jaxps.rank(), (3,)))}
    sgd = jaxps.DistributedOptimizer(optax.sgd(1.0))
    adam = jaxps.DistributedOptimizer(optax.adam(1.0))

    @jax.jit
    def two_optimizers(s1, s2):
        u1, s1 = sgd.update(grads, s1, params)
        u2, s2 = adam.update(grads, s2, params)
        return u1, u2

    u1, _ = two_optimizers(sgd.init(params), adam.init(params))
    np.testing.assert_allclose(u1["w"], -total((3,)) / jaxps.size(), rtol=RTOL)


def _mlp_loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


def _mlp(rank, width=256, layers=6):
    keys = jax.random.split(jax.random.key(0), layers)
    params = [jax.random.normal(k, (width, width)) / width**0.5 for k in keys]
    x = jax.random.normal(jax.random.key(rank + 1), (128, width))
    return params, x


def check_overlap():
    # jaxps.value_and_grad equals push_pull of jax.grad bit for bit (the
    # servers run --deterministic), and its pushes start during the
    # backward pass, one per layer as its gradient is complete.
    from jaxps.ops import _host

    params, x = _mlp(jaxps.rank())
    reference = jax.jit(
        lambda p, x: jaxps.push_pull(jax.grad(_mlp_loss)(p, x), name="ref")
    )
    # one leaf a bucket: each push starts as its layer's backward ends
    overlapped = jax.jit(
        jaxps.value_and_grad(_mlp_loss, name="vg", bucket_bytes=1)
    )
    bucketed = jax.jit(jaxps.value_and_grad(_mlp_loss, name="vgb"))
    # three buckets of two layers, in flight at once: each has its own
    # call check (one shared check counter runs too far ahead)
    pairs = jax.jit(
        jaxps.value_and_grad(_mlp_loss, name="vgp", bucket_bytes=2 << 18)
    )
    starts, start = [], _host.start

    def timed(*args, **kwargs):
        starts.append(time.perf_counter())
        return start(*args, **kwargs)

    _host.start = timed
    try:
        for _ in range(3):
            starts.clear()
            began = time.perf_counter()
            value, grads = jax.block_until_ready(overlapped(params, x))
            step = time.perf_counter() - began
    finally:
        _host.start = start
    want = reference(params, x)
    for got, ref in zip(grads, want):
        np.testing.assert_array_equal(got, ref)
    # default buckets of 1 MiB: 4 layers of 256 KiB each, then 2
    for got, ref in zip(bucketed(params, x)[1], want):
        np.testing.assert_array_equal(got, ref)
    for _ in range(2):
        for got, ref in zip(pairs(params, x)[1], want):
            np.testing.assert_array_equal(got, ref)
    np.testing.assert_allclose(value, _mlp_loss(params, x), rtol=1e-6)
    assert len(starts) == len(params), starts
    # all at the end of the backward pass, they would be ~1 ms apart. The
    # spread is compared with the local compute before the last start, not
    # with the step: the step also waits for the other rank, which is slow
    # on a loaded machine.
    spread, compute = starts[-1] - starts[0], starts[-1] - began
    assert spread > 0.25 * compute, (spread, compute, step)


def check_overlap_use_order():
    # Default priorities and buckets follow the order in which the loss
    # uses the leaves, not the tree's (sorted keys here and in nnx): the
    # first used goes out first, and each bucket's leaves are used together.
    from flax import nnx

    from jaxps.ops import _host

    calls, start = [], _host.start

    def recorded(names, average, priorities, *rest, **kwargs):
        calls.append(dict(zip(names, priorities)))
        return start(names, average, priorities, *rest, **kwargs)

    params, x = _mlp(jaxps.rank(), width=16, layers=3)
    tree = {"c": params[0], "b": params[1], "a": params[2]}  # used c, b, a

    def loss(p, x):
        # a push_pull of default name inside the loss: the probe trace
        # must not shift its number
        x = jaxps.push_pull(x, average=False)
        return _mlp_loss([p["c"], p["b"], p["a"]], x)

    class Net(nnx.Module):  # attributes sorted: a_out before z_in
        def __init__(self):
            self.z_in = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
            self.norm = nnx.BatchNorm(16, rngs=nnx.Rngs(1))
            self.a_out = nnx.Linear(16, 1, rngs=nnx.Rngs(2))

        def __call__(self, x):
            return self.a_out(self.norm(jnp.tanh(self.z_in(x))))

    def net_loss(model, x):
        return jnp.mean(model(x) ** 2)

    @nnx.jit
    def overlapped(model, x):
        return jaxps.value_and_grad(net_loss, name="uo", bucket_bytes=1)(
            model, x
        )[1]

    @nnx.jit
    def reference(model, x):
        return jaxps.push_pull(nnx.grad(net_loss)(model, x), name="uoref")

    _host.start = recorded
    try:
        grads = jax.jit(jaxps.value_and_grad(loss, name="use", bucket_bytes=1))(
            tree, x
        )
        pytree_calls = list(calls)
        calls.clear()
        models = [Net(), Net()]
        got = overlapped(models[0], x)
        nnx_calls = list(calls)
    finally:
        _host.start = start
    want = reference(models[1], x)
    # first call: the inner push_pull, under its unnumbered default name
    inner, *pushes = pytree_calls
    assert [n.split("@")[0] for n in inner] == ["push_pull"], inner
    assert not next(iter(inner)).split(":")[1].count("."), inner

    def key(name):  # e.g. use['c']:float32[16, 16] -> c
        return re.search(r"\['(\w+)'\]", name).group(1)

    order = [key(n) for c in pushes for n in c]
    assert order == ["a", "b", "c"], order  # backward order: last used first
    prio = {key(n): p for c in pushes for n, p in c.items()}
    assert prio["c"] > prio["b"] > prio["a"], prio
    reference_tree = jax.jit(
        lambda p, x: jaxps.push_pull(jax.grad(loss)(p, x), name="useref")
    )(tree, x)
    for k in tree:
        np.testing.assert_array_equal(grads[1][k], reference_tree[k])
    named = {n: p for c in nnx_calls for n, p in c.items()}
    z = max(p for n, p in named.items() if "z_in" in n)
    a = max(p for n, p in named.items() if "a_out" in n)
    assert z > a, named
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)
    # the probe ran the forward pass on a copy: batch statistics were
    # updated once, as by the reference, and hold no tracer
    for a, b in zip(
        jax.tree.leaves(nnx.state(models[0], nnx.BatchStat)),
        jax.tree.leaves(nnx.state(models[1], nnx.BatchStat)),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def check_overlap_shard_map():
    # The hierarchical path: each device's gradient is reduce-scattered over
    # the local devices in the backward pass; bit for bit push_pull's.
    mesh = jax.make_mesh((4,), ("local",))
    params, _ = _mlp(0, width=16, layers=3)
    params = params + [jnp.ones((5,))]  # a leaf that does not split in 4
    x = jax.device_put(
        jax.random.normal(jax.random.key(jaxps.rank()), (4 * 8, 16)),
        NamedSharding(mesh, P("local")),
    )

    def loss(p, x):
        return _mlp_loss(p[:-1], x) + jnp.sum(p[-1] ** 2 * jnp.mean(x))

    def per_device(p, x):
        ref = jaxps.push_pull(
            jax.grad(loss)(p, x), axis_name="local", name="smref"
        )
        value, grads = jaxps.value_and_grad(
            loss, name="smvg", axis_name="local"
        )(p, x)
        return ref, grads, value[None]

    f = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P("local")),
            out_specs=(P(), P(), P("local")),
            check_vma=False,
        )
    )
    ref, grads, _ = f(params, x)
    for got, want in zip(grads, ref):
        np.testing.assert_array_equal(got, want)


def check_overlap_nnx():
    # nnx.Optimizer under nnx.jit, and a linen-style TrainState, step as
    # with push_pull of the local gradients, bit for bit.
    from flax import nnx
    from flax.training import train_state

    def make():
        return nnx.Sequential(
            nnx.Linear(8, 16, rngs=nnx.Rngs(0)),
            nnx.relu,
            nnx.Linear(16, 1, rngs=nnx.Rngs(1)),
        )

    x = jnp.asarray(contribution(jaxps.rank(), (4, 8)) / 10)

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    @nnx.jit
    def overlapped(model, opt, x):
        value, grads = jaxps.value_and_grad(loss, name="nnx")(model, x)
        opt.update(model, grads)
        return value

    @nnx.jit
    def reference(model, opt, x):
        value, grads = nnx.value_and_grad(loss)(model, x)
        opt.update(model, jaxps.push_pull(grads, name="nnxref"))
        return value

    models = [make(), make()]
    opts = [nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param) for m in models]
    for _ in range(3):
        overlapped(models[0], opts[0], x)
        reference(models[1], opts[1], x)
    for a, b in zip(
        jax.tree.leaves(nnx.state(models[0], nnx.Param)),
        jax.tree.leaves(nnx.state(models[1], nnx.Param)),
    ):
        np.testing.assert_array_equal(a, b)

    params = {"w": jnp.ones((8, 1)) / 8}
    tx = optax.sgd(0.1)
    states = [
        train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
        for _ in range(2)
    ]

    def linen_loss(p, x):
        return jnp.mean((x @ p["w"]) ** 2)

    grads = jaxps.value_and_grad(linen_loss, name="linen")(params, x)[1]
    local = jax.grad(linen_loss)(params, x)
    states[0] = states[0].apply_gradients(grads=grads)
    states[1] = states[1].apply_gradients(
        grads=jaxps.push_pull(local, name="linenref")
    )
    np.testing.assert_array_equal(states[0].params["w"], states[1].params["w"])


def check_vmap():
    x = jnp.asarray(contribution(jaxps.rank(), (3, 4)))
    out = jax.jit(
        jax.vmap(lambda v: jaxps.push_pull(v, average=False, name="vm"))
    )(x)
    np.testing.assert_allclose(out, total((3, 4)), rtol=RTOL)


def check_shard_map():
    mesh = jax.make_mesh((4,), ("local",))
    shape = (4, 7, 3)  # leading axis: one slice per local device
    x = jax.device_put(
        jnp.asarray(contribution(jaxps.rank(), shape)),
        NamedSharding(mesh, P("local")),
    )

    def per_device(v):  # v: this device's (1, 7, 3) slice
        return jaxps.push_pull(
            v[0], average=False, axis_name="local", name="sm"
        )[None]

    f = jax.jit(
        jax.shard_map(
            per_device, mesh=mesh, in_specs=P("local"), out_specs=P("local")
        )
    )
    out = np.asarray(f(x))
    expected = total(shape).sum(axis=0)
    for d in range(4):
        np.testing.assert_allclose(out[d], expected, rtol=RTOL)


def check_pmap():
    shape = (4, 5)
    x = contribution(jaxps.rank(), shape)
    out = jax.pmap(
        lambda v: jaxps.push_pull(v, axis_name="i", name="pm"), axis_name="i"
    )(x)
    expected = total(shape).sum(axis=0) / (4 * jaxps.size())
    np.testing.assert_allclose(
        np.asarray(out), np.broadcast_to(expected, shape), rtol=RTOL
    )


def check_broadcast():
    rng = np.random.default_rng(100 + jaxps.rank())  # differs per rank
    params = {
        "w": jnp.asarray(rng.standard_normal((3, 3)), jnp.float32),
        "step": jnp.int32(jaxps.rank() + 5),
    }
    out = jaxps.broadcast(params, root=0)
    root = np.random.default_rng(100).standard_normal((3, 3))
    np.testing.assert_array_equal(out["w"], root.astype(np.float32))
    assert int(out["step"]) == 5


def _linear_data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 5)).astype(np.float32)
    y = x @ np.arange(1, 6, dtype=np.float32) + 0.3
    return x, y


def _loss(params, x, y):
    pred = x @ params["w"] + params["b"]
    return jnp.mean((pred - y) ** 2)


def _trajectory(tx, params, batches):
    """The params after each step, and the final optimizer state."""
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    trajectory = []
    for x, y in batches:
        params, state = step(params, state, x, y)
        trajectory.append(params)
    return trajectory, state


def _train(tx, params, batches):
    return _trajectory(tx, params, batches)[0][-1]


def check_optimizer_equivalence():
    """2 workers on half the batch each == 1 process on the full batch."""
    x, y = _linear_data()
    n, r = jaxps.size(), jaxps.rank()
    params = {"w": jnp.zeros(5), "b": jnp.zeros(())}
    for make in (lambda: optax.sgd(0.05), lambda: optax.adam(0.05)):
        full = [(x, y)] * 20
        part = [(x[r::n], y[r::n])] * 20
        reference = _train(make(), params, full)
        dist = _train(
            jaxps.DistributedOptimizer(make(), name="eq"), params, part
        )
        for key in params:
            np.testing.assert_allclose(
                dist[key], reference[key], rtol=2e-4, atol=1e-5
            )


def check_accumulation():
    """k mini-steps of 1/k of the data == one step on all of it."""
    x, y = _linear_data()
    n, r, k = jaxps.size(), jaxps.rank(), 2
    params = {"w": jnp.zeros(5), "b": jnp.zeros(())}
    reference = _train(optax.adam(0.05), params, [(x, y)] * 5)
    mine = x[r::n], y[r::n]
    minis = [(mine[0][i::k], mine[1][i::k]) for i in range(k)]
    tx = jaxps.DistributedOptimizer(
        optax.adam(0.05), backward_passes_per_step=k, name="acc"
    )
    dist = _train(tx, params, minis * 5)
    for key in params:
        np.testing.assert_allclose(
            dist[key], reference[key], rtol=2e-4, atol=1e-5
        )


def _assert_bitwise(actual, expected):
    leaves, treedef = jax.tree.flatten(actual)
    assert treedef == jax.tree.structure(expected), (actual, expected)
    for a, e in zip(leaves, jax.tree.leaves(expected)):
        a, e = np.asarray(a), np.asarray(e)
        assert (a.dtype, a.shape) == (e.dtype, e.shape), (a, e)
        assert a.tobytes() == e.tobytes(), (a, e)


def check_sync_gradients():
    """optax.chain(sync_gradients(), inner) == DistributedOptimizer(inner)."""
    x, y = _linear_data()
    n, r = jaxps.size(), jaxps.rank()
    params = {"w": jnp.zeros(5), "b": jnp.zeros(())}
    part = [(x[r::n], y[r::n])] * 10
    topk = jaxps.compression.topk(0.5)
    cases = [(optax.adam, None), (optax.sgd, None), (optax.adam, topk)]
    for i, (make, comp) in enumerate(cases):
        chained = optax.chain(
            jaxps.sync_gradients(name=f"sg{i}", compression=comp), make(0.05)
        )
        wrapped = jaxps.DistributedOptimizer(
            make(0.05), name=f"do{i}", compression=comp
        )
        got, (sync_state, inner_state) = _trajectory(chained, params, part)
        want, state = _trajectory(wrapped, params, part)
        _assert_bitwise(got, want)
        _assert_bitwise(inner_state, state.inner_state)
        _assert_bitwise(
            sync_state,
            jaxps.SyncGradientsState(
                state.grad_acc, state.mini_step, state.compression_state
            ),
        )
    # and it did synchronize: every worker holds the same parameters
    root = jaxps.broadcast(got[-1], name="sg_check")
    jax.tree.map(np.testing.assert_array_equal, got[-1], root)


def check_sync_gradients_accumulation():
    """backward_passes_per_step=2 chained == DistributedOptimizer's, per step.

    With a stateless optimizer the zeros that sync_gradients returns between
    communications leave the parameters as DistributedOptimizer does. The
    learning rate is a power of two: XLA may fuse ``params - lr * mean``
    into one multiply-add in the chain (where sgd runs outside the
    `lax.cond`) and not in DistributedOptimizer, and an exact product rounds
    the same either way.
    """
    x, y = _linear_data()
    n, r, k = jaxps.size(), jaxps.rank(), 2
    params = {"w": jnp.zeros(5), "b": jnp.zeros(())}
    mine = x[r::n], y[r::n]
    minis = [(mine[0][i::k], mine[1][i::k]) for i in range(k)]
    minis = minis * 5 + minis[:1]  # ends between two communications
    chained = optax.chain(
        jaxps.sync_gradients(backward_passes_per_step=k, name="sgacc"),
        optax.sgd(2**-4),
    )
    wrapped = jaxps.DistributedOptimizer(
        optax.sgd(2**-4), backward_passes_per_step=k, name="doacc"
    )
    got, (sync_state, _) = _trajectory(chained, params, minis)
    want, state = _trajectory(wrapped, params, minis)
    _assert_bitwise(got, want)
    _assert_bitwise(sync_state.grad_acc, state.grad_acc)
    assert int(sync_state.mini_step) == int(state.mini_step) == 1
    _assert_bitwise(got[0], params)  # a mini-step between communications
    assert not np.array_equal(got[1]["w"], params["w"])  # communicated


def check_flax():
    """Works with nnx.Optimizer and with a linen TrainState."""
    from flax import nnx
    from flax.training import train_state

    x, y = _linear_data()
    model = nnx.Linear(5, 1, rngs=nnx.Rngs(jaxps.rank()))
    nnx.update(model, jaxps.broadcast(nnx.state(model, nnx.Param)))
    opt = nnx.Optimizer(
        model,
        jaxps.DistributedOptimizer(optax.sgd(0.05), name="nnx"),
        wrt=nnx.Param,
    )

    @nnx.jit
    def step(model, opt, x, y):
        def loss(m):
            return jnp.mean((m(x)[:, 0] - y) ** 2)

        grads = nnx.grad(loss)(model)
        opt.update(model, grads)

    n, r = jaxps.size(), jaxps.rank()
    for _ in range(3):
        step(model, opt, x[r::n], y[r::n])
    kernel = jaxps.broadcast(model.kernel[...], name="nnx_check")
    np.testing.assert_allclose(model.kernel[...], kernel, rtol=1e-6)

    state = train_state.TrainState.create(
        apply_fn=None,
        params={"w": jnp.zeros(5), "b": jnp.zeros(())},
        tx=jaxps.DistributedOptimizer(optax.sgd(0.05), name="linen"),
    )

    @jax.jit
    def linen_step(state, x, y):
        grads = jax.grad(_loss)(state.params, x, y)
        return state.apply_gradients(grads=grads)

    state = linen_step(state, x[r::n], y[r::n])
    reference = _train(
        optax.sgd(0.05), {"w": jnp.zeros(5), "b": jnp.zeros(())}, [(x, y)]
    )
    np.testing.assert_allclose(state.params["w"], reference["w"], rtol=1e-5)


def check_async():
    """Async mode (servers started with --async) still converges."""
    x, y = _linear_data()
    n, r = jaxps.size(), jaxps.rank()
    params = {"w": jnp.zeros(5), "b": jnp.zeros(())}
    tx = jaxps.AsyncDistributedOptimizer(optax.sgd(0.05), name="async")
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    first = float(_loss(params, x, y))
    for _ in range(150):
        params, state = step(params, state, x[r::n], y[r::n])
    assert float(_loss(params, x, y)) < 0.01 * first, float(_loss(params, x, y))


def _grads(rank, step, d=257):
    rng = np.random.default_rng(1000 * step + rank)
    return rng.standard_normal(d).astype(np.float32)


def _reference(kind, n, steps, ratio=0.1):
    """The workers' mean per step, computed in numpy for all ranks."""
    d = _grads(0, 0).size
    k = max(1, round(ratio * d))
    residual = [np.zeros(d, np.float32) for _ in range(n)]
    means = []
    for step in range(steps):
        total = np.zeros(d, np.float64)
        for r in range(n):
            acc = _grads(r, step) + residual[r]
            if kind == "topk":
                idx = np.argsort(-np.abs(acc), kind="stable")[:k]
                sent = np.zeros(d, np.float32)
                sent[idx] = acc[idx]
            elif kind == "onebit":
                sent = np.mean(np.abs(acc)) * np.where(acc >= 0, 1.0, -1.0)
            else:
                sent = acc.astype(kind).astype(np.float32)
            total += sent
            residual[r] = acc - sent if kind in ("topk", "onebit") else 0
        means.append((total / n).astype(np.float32))
    return means


def check_compression():
    from jaxps import compression as c

    n, r = jaxps.size(), jaxps.rank()
    schemes = {
        "topk": c.topk(0.1),
        "onebit": c.onebit(),
        np.float16: c.fp16(),
    }
    for kind, scheme in schemes.items():
        tx = jaxps.DistributedOptimizer(
            optax.sgd(1.0), compression=scheme, name=f"c{kind}"
        )
        params = jnp.zeros(257)
        state = tx.init(params)
        update = jax.jit(tx.update)
        expected = _reference(kind, n, steps=3)
        for step in range(3):
            updates, state = update(jnp.asarray(_grads(r, step)), state, params)
            np.testing.assert_allclose(
                -np.asarray(updates),
                expected[step],
                rtol=2e-3,
                atol=1e-5,
                err_msg=f"{kind} step {step}",
            )
    # random-k: every worker keeps the same coordinates
    tx = jaxps.DistributedOptimizer(
        optax.sgd(1.0), compression=c.randomk(0.1, seed=3), name="crk"
    )
    state = tx.init(jnp.zeros(257))
    updates, state = jax.jit(tx.update)(
        jnp.asarray(_grads(r, 0)), state, jnp.zeros(257)
    )
    kept = np.flatnonzero(np.asarray(updates))
    assert len(kept) == 26, len(kept)
    mean = sum(_grads(q, 0) for q in range(n)) / n
    np.testing.assert_allclose(
        -np.asarray(updates)[kept], mean[kept], rtol=1e-5
    )
    residual = np.asarray(state.compression_state.residual)
    np.testing.assert_allclose(residual[kept], 0, atol=1e-6)


def main(names, checks=None):
    """Runs ``check_NAME`` of `checks` (a module's globals, default this
    one's) for each name, printing ``ok NAME`` after each."""
    checks = globals() if checks is None else checks
    jaxps.init()
    try:
        for name in names:
            checks[f"check_{name}"]()
            print(f"ok {name}", flush=True)
    finally:
        jaxps.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
