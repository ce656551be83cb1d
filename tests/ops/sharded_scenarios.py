"""One jaxps worker on a host of several devices; started once per rank.

Run by test_sharded.py as ``python sharded_scenarios.py NAME...`` with the
JAXPS_* environment of a job and XLA_FLAGS forcing L CPU devices. The model
is of realistic size (a 1024x1024 layer: 4 MiB of gradient), the size at
which host callbacks beside collectives used to deadlock. Every check
compares with one process that trains on the whole batch, without jaxps,
and prints ``ok NAME``.
"""

import contextlib
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scenarios  # this file's folder: the checks' runner
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxps
from jaxps.ops import _host

WIDTH = int(os.environ.get("WIDTH", "1024"))
STEPS = 3
RTOL, ATOL = 2e-4, 2e-6

pushed: list[tuple[int, int]] = []  # (shard, bytes) of each device's start
operands: list[int] = []  # operands of each start callback
dones: list[int] = []  # one entry per done callback
_start, _done = _host.start, _host.done


def _recorded(names, average, priorities, mode, shard, *arrays, **kwargs):
    pushed.append((int(shard), sum(a.nbytes for a in arrays)))
    operands.append(len(arrays))
    return _start(names, average, priorities, mode, shard, *arrays, **kwargs)


def _recorded_done(ticket):
    dones.append(1)
    return _done(ticket)


_host.start, _host.done = _recorded, _recorded_done


def _real_data():
    rng = np.random.default_rng(0)
    params = {
        "w": rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.03,
        "b": np.zeros(WIDTH, np.float32),
    }
    x = rng.standard_normal((8 * jax.device_count() * jaxps.size(), WIDTH))
    return params, x.astype(np.float32)


def _real_loss(params, x):
    return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2)


# the data and loss of every check; `_exactly` swaps them
_data, _loss = _real_data, _real_loss


def _mine(x):
    return x[jaxps.rank() :: jaxps.size()]


def _reference(params, x):
    """STEPS of sgd on the whole batch, one process, no jaxps."""
    tx = optax.sgd(0.5)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(_loss)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(STEPS):
        params, state = step(params, state)
    return params


def _assert_close(actual, expected):
    for key in expected:
        np.testing.assert_allclose(
            np.asarray(actual[key]),
            np.asarray(expected[key]),
            rtol=RTOL,
            atol=ATOL,
            err_msg=key,
        )


def _assert_sharding_kept(out, placed):
    for key in placed:
        a, b = out[key].sharding, placed[key].sharding
        assert a.is_equivalent_to(b, out[key].ndim), (key, a, b)


def _assert_slices(total_bytes):
    """Each device pushed its own 1/L of the bytes, once per step."""
    devices = jax.device_count()
    shards = sorted({s for s, _ in pushed})
    assert shards == list(range(devices)), shards
    for shard in shards:
        sizes = [b for s, b in pushed if s == shard]
        # a slice is padded up to a multiple of the device count
        assert max(sizes) <= total_bytes // devices + 4 * devices, sizes
    assert sum(b for _, b in pushed) >= total_bytes * STEPS
    pushed.clear()


def _mesh(kind):
    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh(
        (jax.device_count(),), ("data",), axis_types=(axis_type,)
    )


def _train(kind, make_step):
    """STEPS of `make_step`'s step on this rank's half of the batch, on a
    mesh of `kind`: explicit axes, Auto axes in context (jax.set_mesh), or
    Auto axes not in context (found at lowering)."""
    params, x = _data()
    mesh = _mesh(kind)
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    batch = jax.device_put(_mine(x), NamedSharding(mesh, P("data")))
    step, state = make_step(placed)
    pushed.clear()
    out = placed
    with jax.set_mesh(mesh) if kind == "set_mesh" else contextlib.nullcontext():
        for _ in range(STEPS):
            out, state = step(out, state, batch)
    _assert_close(out, _reference(params, x))
    _assert_sharding_kept(out, placed)
    _assert_slices(sum(v.nbytes for v in params.values()))
    return out


def _step(params, grads_of, tx=None):
    """A jitted SGD step on `grads_of(params, x)`, and its first state."""
    tx = optax.sgd(0.5) if tx is None else tx

    @jax.jit
    def step(params, state, x):
        updates, state = tx.update(grads_of(params, x), state, params)
        return optax.apply_updates(params, updates), state

    return step, tx.init(params)


def _optimizer_step(params):
    tx = jaxps.DistributedOptimizer(optax.sgd(0.5), name="opt")
    return _step(params, jax.grad(_loss), tx)


def _value_and_grad_step(params):
    return _step(
        params, lambda p, x: jaxps.value_and_grad(_loss, name="vg")(p, x)[1]
    )


def _push_pull_step(params):
    return _step(
        params, lambda p, x: jaxps.push_pull(jax.grad(_loss)(p, x), name="pp")
    )


def _shard_map_step(params, grads_of=None):
    """The documented shard_map path, with the default check_vma: the
    gradients of `grads_of(params, x)`, push_pull after jax.grad by
    default."""
    if grads_of is None:

        def grads_of(params, x):
            return jaxps.push_pull(
                jax.grad(_loss)(params, x), axis_name="data", name="sm"
            )

    sharded = jax.shard_map(
        grads_of, mesh=_mesh("auto"), in_specs=(P(), P("data")), out_specs=P()
    )
    return _step(params, sharded)


def check_optimizer():
    for kind in ("explicit", "set_mesh", "auto"):
        _train(kind, _optimizer_step)


def check_value_and_grad():
    for kind in ("explicit", "set_mesh"):
        _train(kind, _value_and_grad_step)


def check_push_pull():
    for kind in ("explicit", "set_mesh", "auto"):
        _train(kind, _push_pull_step)


def check_shard_map():
    _train("auto", _shard_map_step)


def check_sums_agree():
    """The summed gradients of a sharded jit are the same bits however
    jaxps found the mesh (explicit axes, jax.set_mesh, or an Auto mesh at
    lowering), and agree with shard_map's, with and without check_vma, to
    1e-6 of the largest element (XLA's reduction over the host's devices
    rounds a few elements differently there: measured 5 ulp of it)."""
    params, x = _data()
    sums = {}
    for kind in ("explicit", "set_mesh", "auto"):
        mesh = _mesh(kind)
        placed = jax.device_put(params, NamedSharding(mesh, P()))
        batch = jax.device_put(_mine(x), NamedSharding(mesh, P("data")))
        step = jax.jit(
            lambda p, x, kind=kind: jaxps.push_pull(
                jax.grad(_loss)(p, x), name=f"bits-{kind}"
            )
        )
        with (
            jax.set_mesh(mesh)
            if kind == "set_mesh"
            else (contextlib.nullcontext())
        ):
            sums[kind] = step(placed, batch)
    mesh = _mesh("auto")
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    batch = jax.device_put(_mine(x), NamedSharding(mesh, P("data")))
    for vma in (True, False):
        sums[f"shard_map vma={vma}"] = jax.jit(
            jax.shard_map(
                lambda p, x, vma=vma: jaxps.push_pull(
                    jax.grad(_loss)(p, x), axis_name="data", name=f"b{vma}"
                ),
                mesh=mesh,
                in_specs=(P(), P("data")),
                out_specs=P(),
                check_vma=vma,
            )
        )(placed, batch)
    first = {k: np.asarray(v) for k, v in sums.pop("explicit").items()}
    for kind, other in sums.items():
        for key, a in first.items():
            b = np.asarray(other[key])
            if kind in ("set_mesh", "auto"):
                assert a.tobytes() == b.tobytes(), (kind, key)
            else:
                scale = float(np.max(np.abs(a)))
                np.testing.assert_allclose(b, a, rtol=0, atol=1e-6 * scale)


def check_paths_agree():
    """The sharded jit and the shard_map path end with the same parameters,
    to float rounding: the host's devices sum their gradients in XLA's
    all-reduce on one, its reduce-scatter on the other, so not bit for bit
    even with --deterministic servers."""
    a = _train("explicit", _optimizer_step)
    b = _train("auto", _shard_map_step)
    for key in a:
        np.testing.assert_allclose(
            np.asarray(a[key]), np.asarray(b[key]), rtol=1e-5, atol=1e-7
        )


def _exact_data():
    """Small integers: with `_exact_loss` every sum in the gradient is exact
    in float32, whatever its order."""
    params, _ = _real_data()
    rng = np.random.default_rng(1)
    x = rng.integers(-2, 3, (8 * jax.device_count() * jaxps.size(), WIDTH))
    return params, x.astype(np.float32)


def _exact_loss(params, x):
    """Linear in the parameters: the gradient is x^T y and the column sums
    of y over powers of two, independent of the parameters."""
    y = jnp.roll(x, 1, axis=1)
    return jnp.mean((x @ params["w"] + params["b"]) * y)


@contextlib.contextmanager
def _exactly():
    """Every check run inside trains on `_exact_data` and `_exact_loss` and
    must end with the bits of one process on the whole batch."""
    global _data, _loss, RTOL, ATOL
    saved = _data, _loss, RTOL, ATOL
    _data, _loss, RTOL, ATOL = _exact_data, _exact_loss, 0.0, 0.0
    try:
        yield
    finally:
        _data, _loss, RTOL, ATOL = saved


def check_bitwise():
    """Where float sums are exact, every path ends with the same bits as
    one process on the whole batch (the 1-device reference): sharded jit
    however the mesh is found, each API, shard_map, its overlap, pmap. What
    differs between paths is then only the order of rounding (see
    sums_agree), never a missing, doubled or misscaled piece."""
    with _exactly():
        for kind in ("explicit", "set_mesh", "auto"):
            _train(kind, _optimizer_step)
        _train("explicit", _push_pull_step)
        _train("set_mesh", _value_and_grad_step)
        _train("auto", _shard_map_step)
        _train(
            "auto", functools.partial(_shard_map_step, grads_of=_overlap_grads)
        )
        check_pmap()


def check_linen():
    from flax.training import train_state

    params, x = _data()
    mesh = _mesh("explicit")
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    state = train_state.TrainState.create(
        apply_fn=None,
        params=placed,
        tx=jaxps.DistributedOptimizer(optax.sgd(0.5), name="linen"),
    )
    batch = jax.device_put(_mine(x), NamedSharding(mesh, P("data")))

    @jax.jit
    def step(state, x):
        return state.apply_gradients(grads=jax.grad(_loss)(state.params, x))

    for _ in range(STEPS):
        state = step(state, batch)
    _assert_close(state.params, _reference(params, x))
    _assert_sharding_kept(state.params, placed)


def check_explicit_2d():
    """A data x model mesh with explicit axes under plain jax.jit: w sharded
    over "model" keeps that sharding, and each device pushes a slice of its
    own model shard (1/data of it), not 1/L of the whole gradient."""
    devices = jax.device_count()
    data, model = devices // 2, 2
    mesh = jax.make_mesh((data, model), ("data", "model"))
    params, x = _data()
    placed = {
        "w": jax.device_put(params["w"], NamedSharding(mesh, P(None, "model"))),
        "b": jax.device_put(params["b"], NamedSharding(mesh, P())),
    }
    batch = jax.device_put(_mine(x), NamedSharding(mesh, P("data")))
    step, state = _optimizer_step(placed)
    pushed.clear()
    out = placed
    for _ in range(STEPS):
        out, state = step(out, state, batch)
    _assert_close(out, _reference(params, x))
    _assert_sharding_kept(out, placed)
    w, b = params["w"].nbytes, params["b"].nbytes
    per_device = w // model // data + -(-b // devices)  # its w slice, b's
    sizes = {size for _, size in pushed}
    assert max(sizes) <= per_device + 16, (sizes, per_device)
    assert sorted({s for s, _ in pushed}) == list(range(devices))
    pushed.clear()


def check_nnx_2d():
    """flax's "scale up" program: a data x model mesh, kernels sharded over
    "model", nnx.jit; the sharding survives the step."""
    from flax import nnx

    devices = jax.device_count()
    mesh = jax.make_mesh(
        (devices // 2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2
    )
    _, x = _data()

    class MLP(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.w1 = nnx.Param(
                nnx.with_partitioning(init, (None, "model"))(
                    rngs.params(), (WIDTH, WIDTH)
                )
            )
            self.w2 = nnx.Param(
                nnx.with_partitioning(init, ("model", None))(
                    rngs.params(), (WIDTH, 16)
                )
            )

        def __call__(self, x):
            return jnp.tanh(x @ self.w1[...]) @ self.w2[...]

    def make(tx):
        with jax.set_mesh(mesh):
            model = MLP(nnx.Rngs(0))
            state = nnx.state(model)
            nnx.update(
                model,
                jax.lax.with_sharding_constraint(
                    state, nnx.get_partition_spec(state)
                ),
            )
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)

    def run(tx, x):
        model, opt = make(tx)
        before = {k: v.sharding for k, v in nnx.state(model).flat_state()}
        placed = jax.device_put(x, NamedSharding(mesh, P("data")))
        with jax.set_mesh(mesh):
            for _ in range(STEPS):
                step(model, opt, placed)
        after = nnx.state(model)
        for key, value in after.flat_state():
            sharding = value.sharding
            assert sharding.is_equivalent_to(before[key], value.ndim), (
                key,
                sharding,
                before[key],
            )
        return {str(k): np.asarray(v[...]) for k, v in after.flat_state()}

    mine = run(jaxps.DistributedOptimizer(optax.sgd(0.5), name="nnx"), _mine(x))
    _assert_close(mine, run(optax.sgd(0.5), x))


def _pmap_step(params):
    tx = optax.sgd(0.5)
    devices = jax.device_count()

    def grads_of(p, x):
        return jaxps.push_pull(jax.grad(_loss)(p, x), axis_name="i", name="pm")

    mapped = jax.pmap(grads_of, axis_name="i", in_axes=(None, 0))

    def step(params, state, x):
        x = np.asarray(x).reshape(devices, -1, x.shape[-1])
        grads = jax.tree.map(lambda g: g[0], mapped(params, x))
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step, tx.init(params)


def _overlap_grads(params, x):
    """jaxps.value_and_grad inside shard_map (pushes in the backward pass)."""
    return jaxps.value_and_grad(_loss, axis_name="data", name="ov")(params, x)[
        1
    ]


def check_pmap():
    params, x = _data()
    step, state = _pmap_step(params)
    pushed.clear()
    out = params
    for _ in range(STEPS):
        out, state = step(out, state, _mine(x))
    _assert_close(out, _reference(params, x))
    _assert_slices(sum(v.nbytes for v in params.values()))


def check_overlap_shard_map():
    _train("auto", functools.partial(_shard_map_step, grads_of=_overlap_grads))


def check_broadcast_and_batch_stats():
    """broadcast and sync_batch_stats under a sharded jit: rank 0's value
    (or the mean) on every device, with the input's sharding."""
    for kind in ("explicit", "set_mesh"):
        mesh = _mesh(kind)
        mine = np.full((WIDTH, 8), jaxps.rank() + 1.0, np.float32)
        placed = jax.device_put(mine, NamedSharding(mesh, P()))
        with (
            jax.set_mesh(mesh)
            if kind == "set_mesh"
            else contextlib.nullcontext()
        ):
            root = jax.jit(functools.partial(jaxps.broadcast, name=f"b{kind}"))(
                placed
            )
            mean = jax.jit(
                functools.partial(jaxps.sync_batch_stats, name=f"s{kind}")
            )({"m": placed})["m"]
        np.testing.assert_array_equal(np.asarray(root), np.ones_like(mine))
        expected = (jaxps.size() + 1) / 2
        np.testing.assert_allclose(np.asarray(mean), expected, rtol=1e-6)
        for out in (root, mean):
            assert out.sharding.is_equivalent_to(placed.sharding, 2), (
                kind,
                out.sharding,
            )


default_fuse = _host.CPU_FUSE_BYTES


def _crossing_run(fused, params, x, loss):
    """Two counted steps of DistributedOptimizer; the parameters after."""
    devices = jax.device_count()
    _host.CPU_FUSE_BYTES = default_fuse if fused else 0
    tx = jaxps.DistributedOptimizer(optax.sgd(0.1), name=f"c{fused}")

    @jax.jit
    def step(params, state, x):
        updates, state = tx.update(jax.grad(loss)(params, x), state)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    params, state = step(params, state, x)  # compiles
    jax.block_until_ready(params)
    operands.clear(), dones.clear(), pushed.clear()
    copies = _host.host_copies
    for _ in range(2):
        params, state = step(params, state, x)
    jax.block_until_ready(params)
    # the callbacks' operands are host copies already: none made again
    assert _host.host_copies == copies, _host.host_copies - copies
    assert len(operands) == 2 * devices, operands
    assert set(operands) == ({2} if fused else {200}), operands
    assert len(dones) == 2 * devices, dones
    return params


def check_crossings():
    """A model of 200 leaves of two dtypes on a mesh: per step one start
    and one done callback per device, no host copy beyond the callback's
    own; fused, one operand per dtype (one device-to-host copy each, as on
    GPUs), else one per leaf; the same sums either way."""
    devices = jax.device_count()
    mesh = _mesh("explicit")
    rng = np.random.default_rng(1)
    params = {
        f"p{i:03d}": rng.standard_normal((16, 8)).astype(
            np.float32 if i % 4 else jnp.bfloat16
        )
        for i in range(200)
    }
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    x = jax.device_put(
        rng.standard_normal((4 * devices, 16)).astype(np.float32),
        NamedSharding(mesh, P("data")),
    )

    def loss(params, x):
        return sum(
            jnp.sum(jnp.tanh(x @ w.astype(jnp.float32)))
            for w in params.values()
        )

    try:
        results = {
            fused: _crossing_run(fused, placed, x, loss)
            for fused in (False, True)
        }
    finally:
        _host.CPU_FUSE_BYTES = default_fuse
    for key in params:
        a, b = np.asarray(results[False][key]), np.asarray(results[True][key])
        assert a.tobytes() == b.tobytes(), key


def _raises(fn, *words):
    try:
        fn()
    except ValueError as err:
        for word in words:
            assert word in str(err), (word, str(err))
        return
    raise AssertionError(f"no error; expected one naming {words}")


def check_errors():
    """Calls that cannot place themselves fail at trace time, naming what
    to pass."""
    devices = jax.device_count()
    x = jnp.ones((devices, 4))
    _raises(
        lambda: jax.pmap(lambda v: jaxps.push_pull(v), axis_name="i")(x),
        "axis_name='i'",
    )
    mesh = _mesh("auto")
    _raises(
        lambda: jax.jit(
            jax.shard_map(
                lambda v: jaxps.push_pull(v),
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P("data"),
            )
        )(x),
        "axis_name='data'",
    )
    # value_and_grad's overlap runs per device: in a jit over an Auto mesh
    # that is not in context, it cannot find the devices when it traces
    params, batch = _data()
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    batch = jax.device_put(_mine(batch), NamedSharding(mesh, P("data")))
    _raises(
        lambda: jax.jit(jaxps.value_and_grad(_loss, name="noplace"))(
            placed, batch
        ),
        "jax.set_mesh",
        "mesh=mesh",
    )


def check_retune():
    """partition_bytes="auto" measuring again while sharded steps run
    (`_measure_again`): the ranks measure every other epoch of 2 calls,
    inside the devices' start callbacks of shard_map, while the other
    devices' callbacks wait for the choice, and the partition changes each
    time. A sharded jit after it goes through the same partitions (its
    calls count from 0). Training on exact data ends with the bits of one
    process on the whole batch."""
    global STEPS
    from jaxps._src import state

    saved, STEPS = STEPS, 12
    try:
        with _exactly():
            _train("auto", _shard_map_step)
            _train("explicit", _push_pull_step)
    finally:
        STEPS = saved
    runtime = state.runtime()
    suffixes = {w.rpartition("@")[2] for w in runtime._rounds}
    # the reference at calls 2, 6 and 10, measured at calls 4 and 8
    assert runtime._retune.measured == 2, runtime._retune.measured
    assert {f"{p}B" for p in RETUNED[1:]} <= suffixes, suffixes


#: What `check_retune`'s measurements choose, in turn (init: the first).
RETUNED = (65536, 262144, 131072)


def _measure_again():
    """Before init, for `check_retune`: the ranks measure on loopback (as
    they would across hosts), with epochs of 2 calls, and any rate counts
    as moved. The measurement is the real one; what it chooses is
    replaced by `RETUNED` in turn (the same on every rank)."""
    from jaxps._src import retune, tuning

    real, measured = tuning.measure, []

    def measure(push_pull, num_servers, rank, size):
        tuned = real(push_pull, num_servers, rank, size)
        measured.append(tuned)
        chosen = RETUNED[(len(measured) - 1) % len(RETUNED)]
        return tuned._replace(partition_bytes=chosen)

    tuning.ON_ONE_HOST, tuning.measure = True, measure
    retune.CHANGE = 0.0
    os.environ["JAXPS_RETUNE_CALLS"] = "2"


if __name__ == "__main__":
    if "retune" in sys.argv[1:]:
        _measure_again()
    scenarios.main(sys.argv[1:], globals())
